// Package dlockotel reports what dlock's locks do as OpenTelemetry metrics
// and spans. New returns a dlock.Observer; set it as the Locker's
// Options.Observer:
//
//	obs, err := dlockotel.New() // the global meter and tracer providers
//	if err != nil { ... }
//	locker := dlock.New(backend, &dlock.Options{Observer: obs})
//
// Metrics (instrumentation scope ScopeName):
//
//	dlock.acquire.duration  histogram, s   dlock.mode, dlock.wait, dlock.outcome
//	dlock.acquisitions      counter        dlock.mode, dlock.wait, dlock.outcome
//	dlock.held              up/down        dlock.mode
//	dlock.hold.duration     histogram, s   dlock.mode, dlock.end
//	dlock.renewal.lead      histogram, s   dlock.mode
//	dlock.losses            counter        dlock.mode, dlock.loss.cause
//
// dlock.outcome is acquired, conflict (TryAcquire found the key held),
// gave_up (the caller's context ended first) or error; dlock.end is
// released, closed (by Locker.Close) or lost; dlock.loss.cause is expired,
// store_error, not_held or session (see dlock.LossCause). dlock.held
// counts leases, not reentrant Locks. dlock.renewal.lead is how long before
// the lease's safe deadline each renewal was confirmed: leads near zero
// mean the TTL is too short for the store's latency.
//
// Spans: dlock.acquire around each acquisition (the store's calls run in
// its context) and dlock.release around each release, with the same
// attributes plus dlock.fence and dlock.reentrant; a status of Error for an
// acquisition that failed (not for a conflict or a wait given up) and a
// release that failed.
//
// Keys are not attributes unless WithKeys or WithKeyAttributes says so:
// each key makes its own series.
package dlockotel
