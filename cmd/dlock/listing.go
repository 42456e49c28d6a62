package main

import (
	"context"
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/dlock-dev/dlock"
)

// listWaiters prints who waits for the keys starting with prefix: dlock
// list --waiters. A store that cannot tell is a usage error (exit 64),
// never an empty list, which would read as "nobody waits".
func (a *app) listWaiters(ctx context.Context, s *store, prefix string, asJSON bool) error {
	ws, err := dlock.New(s.backend, nil).ListWaiters(ctx, prefix)
	switch {
	case errors.Is(err, dlock.ErrUnsupported):
		return usageError("%s cannot list waiters: the store does not record who waits", s.name)
	case err != nil:
		return a.storeErr(s, err)
	}
	if asJSON {
		out := make([]jsonWaiter, len(ws))
		for i, w := range ws {
			out[i] = jsonWaiter{Key: w.Key, Owner: w.Owner, Metadata: w.Metadata, Mode: w.Mode.String(), Client: w.Client}
			if w.Token != (dlock.Token{}) {
				out[i].OwnerToken = w.Token.String()
			}
			if w.Mode == dlock.ModeLimited {
				out[i].Limit = w.Limit
			}
			if !w.Since.IsZero() {
				at, d := w.Since.UTC(), time.Since(w.Since).Seconds()
				out[i].Since, out[i].Waiting = &at, &d
			}
		}
		return a.encodeJSON(out)
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tMODE\tOWNER\tWAITING\tCLIENT\tMETADATA")
	for _, w := range ws {
		waiting := "-"
		if !w.Since.IsZero() {
			waiting = time.Since(w.Since).Round(100 * time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", printable(w.Key), listMode(dlock.LockInfo{Mode: w.Mode, Limit: w.Limit}),
			orDash(w.Owner), waiting, orDash(w.Client), printable(w.Metadata))
	}
	return tw.Flush()
}

// jsonWaiter is a waiter in dlock list --waiters --json.
type jsonWaiter struct {
	Key        string `json:"key"`
	Owner      string `json:"owner"`
	OwnerToken string `json:"owner_token,omitempty"`
	Metadata   string `json:"metadata"`
	Mode       string `json:"mode"`
	Limit      int    `json:"limit,omitempty"`
	// Since and Waiting are null where the store does not say when the
	// wait began.
	Since   *time.Time `json:"since"`
	Waiting *float64   `json:"waiting_seconds"`
	// Client is the store's name for the waiting connection, where it
	// records no owner token (advisory and named locks).
	Client string `json:"client,omitempty"`
}

// listKeys prints every key starting with prefix that the store keeps a
// record of, held or free: dlock list --all. A store that forgets keys on
// release is a usage error (exit 64).
func (a *app) listKeys(ctx context.Context, s *store, prefix string, asJSON bool) error {
	ks, err := dlock.New(s.backend, nil).ListKeys(ctx, prefix)
	switch {
	case errors.Is(err, dlock.ErrUnsupported):
		return usageError("%s cannot list free keys: the store keeps no record of a key after its release", s.name)
	case err != nil:
		return a.storeErr(s, err)
	}
	if asJSON {
		out := make([]jsonKey, len(ks))
		for i, k := range ks {
			out[i] = jsonKey{Key: k.Key, State: keyState(k), Token: k.Fence, Holders: make([]jsonLock, len(k.Holders)), Expired: k.Expired}
			for j, h := range k.Holders {
				out[i].Holders[j] = newJSONLock(h)
			}
			if k.Last != nil {
				l := newJSONLock(*k.Last)
				if k.Last.Token == (dlock.Token{}) {
					l.OwnerToken = ""
				}
				out[i].Last = &l
			}
			if !k.FreedAt.IsZero() {
				at := k.FreedAt.UTC()
				out[i].FreedAt = &at
			}
		}
		return a.encodeJSON(out)
	}
	tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tSTATE\tOWNER\tTOKEN\tSINCE\tEXPIRES IN\tMETADATA")
	for _, k := range ks {
		for _, h := range k.Holders {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", printable(k.Key), "held:"+listMode(h), orDash(h.Owner), h.Fence,
				h.AcquiredAt.Local().Format(listTime), expiresIn(h), printable(h.Metadata))
		}
		if len(k.Holders) > 0 {
			continue
		}
		owner, meta, since := "-", "", "-"
		if k.Last != nil {
			owner, meta = orDash(k.Last.Owner), printable(k.Last.Metadata)
		}
		if !k.FreedAt.IsZero() {
			since = k.FreedAt.Local().Format(listTime)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t-\t%s\n", printable(k.Key), keyState(k), owner, k.Fence, since, meta)
	}
	return tw.Flush()
}

// keyState is "held", "released" or "expired".
func keyState(k dlock.KeyInfo) string {
	switch {
	case len(k.Holders) > 0:
		return "held"
	case k.Expired:
		return "expired"
	}
	return "released"
}

// jsonKey is a key in dlock list --all --json.
type jsonKey struct {
	Key string `json:"key"`
	// State is "held", "released" or "expired".
	State string `json:"state"`
	// Token is the key's last fencing token.
	Token   uint64     `json:"token"`
	Holders []jsonLock `json:"holders"`
	// Last is the last holder of a free key (null while held, or when the
	// store does not remember it); FreedAt when its lease ended.
	Last    *jsonLock  `json:"last_holder"`
	FreedAt *time.Time `json:"freed_at"`
	Expired bool       `json:"expired"`
}
