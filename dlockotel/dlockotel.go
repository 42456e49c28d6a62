package dlockotel

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/dlock-dev/dlock"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the meter and the tracer.
const ScopeName = "github.com/dlock-dev/dlock/dlockotel"

// Attribute keys.
const (
	KeyKey       = attribute.Key("dlock.key")
	ModeKey      = attribute.Key("dlock.mode")
	WaitKey      = attribute.Key("dlock.wait")
	OutcomeKey   = attribute.Key("dlock.outcome")
	EndKey       = attribute.Key("dlock.end")
	CauseKey     = attribute.Key("dlock.loss.cause")
	FenceKey     = attribute.Key("dlock.fence")
	ReentrantKey = attribute.Key("dlock.reentrant")
)

// An Option configures New.
type Option func(*config)

type config struct {
	mp   metric.MeterProvider
	tp   trace.TracerProvider
	keys func(key string) []attribute.KeyValue
}

// WithMeterProvider sets the meter provider. The default is otel's global
// one (otel.GetMeterProvider) at the time New is called.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) { c.mp = mp }
}

// WithTracerProvider sets the tracer provider. The default is otel's
// global one (otel.GetTracerProvider) at the time New is called.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return func(c *config) { c.tp = tp }
}

// WithKeys adds each lock's key as the attribute dlock.key to its metrics
// and spans. Every key then makes its own metric series: use it only with
// a few, fixed keys. The default leaves keys out.
func WithKeys() Option {
	return WithKeyAttributes(func(key string) []attribute.KeyValue {
		return []attribute.KeyValue{KeyKey.String(key)}
	})
}

// WithKeyAttributes adds fn(key) to each lock's metrics and spans: map
// keys to a few groups (a prefix, a tenant) to keep the number of series
// bounded. fn must be fast and safe for concurrent use. The default adds
// nothing.
func WithKeyAttributes(fn func(key string) []attribute.KeyValue) Option {
	return func(c *config) { c.keys = fn }
}

// Observer records a Locker's events as metrics and spans. Create it with
// New; it is safe for concurrent use, by any number of Lockers.
type Observer struct {
	tracer       trace.Tracer
	acquireDur   metric.Float64Histogram
	acquisitions metric.Int64Counter
	held         metric.Int64UpDownCounter
	holdDur      metric.Float64Histogram
	renewalLead  metric.Float64Histogram
	losses       metric.Int64Counter
	keys         func(string) []attribute.KeyValue
}

var _ dlock.Observer = (*Observer)(nil)

// secondBuckets are the histograms' bucket bounds, in seconds: from a
// store's round trip to a long wait or hold.
var secondBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600}

// New returns an Observer over the meter and tracer providers of opts.
// It fails only when the meter provider refuses to create an instrument.
func New(opts ...Option) (*Observer, error) {
	var c config
	for _, o := range opts {
		o(&c)
	}
	var errs []error
	if c.mp == nil {
		c.mp = otel.GetMeterProvider()
	}
	if c.tp == nil {
		c.tp = otel.GetTracerProvider()
	}
	m := c.mp.Meter(ScopeName)
	o := &Observer{tracer: c.tp.Tracer(ScopeName), keys: c.keys}
	seconds := func(name, desc string) metric.Float64Histogram {
		h, err := m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
			metric.WithExplicitBucketBoundaries(secondBuckets...))
		errs = append(errs, err)
		return h
	}
	o.acquireDur = seconds("dlock.acquire.duration", "Time from the start of an acquisition to its end, whatever the outcome.")
	o.holdDur = seconds("dlock.hold.duration", "Time a lease was held, from its acquisition to its release or loss.")
	o.renewalLead = seconds("dlock.renewal.lead", "Time left before the lease's safe deadline when the store confirmed a renewal.")
	var err error
	o.acquisitions, err = m.Int64Counter("dlock.acquisitions", metric.WithUnit("{acquisition}"),
		metric.WithDescription("Acquisitions, by outcome."))
	errs = append(errs, err)
	o.losses, err = m.Int64Counter("dlock.losses", metric.WithUnit("{loss}"),
		metric.WithDescription("Leases lost while held, by cause."))
	errs = append(errs, err)
	o.held, err = m.Int64UpDownCounter("dlock.held", metric.WithUnit("{lease}"),
		metric.WithDescription("Leases held now."))
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("dlockotel: %w", err)
	}
	return o, nil
}

// attrs returns mode's and key's attributes followed by more.
func (o *Observer) attrs(key string, mode dlock.Mode, more ...attribute.KeyValue) []attribute.KeyValue {
	kv := make([]attribute.KeyValue, 0, 1+len(more)+2)
	kv = append(kv, ModeKey.String(mode.String()))
	kv = append(kv, more...)
	if o.keys != nil {
		kv = append(kv, o.keys(key)...)
	}
	return kv
}

func fence(f uint64) attribute.KeyValue {
	if f > math.MaxInt64 {
		return FenceKey.String(strconv.FormatUint(f, 10))
	}
	return FenceKey.Int64(int64(f))
}

// AcquireStarted starts the span dlock.acquire.
func (o *Observer) AcquireStarted(ctx context.Context, e dlock.AcquireStart) context.Context {
	ctx, _ = o.tracer.Start(ctx, "dlock.acquire", trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(o.attrs(e.Key, e.Mode, WaitKey.Bool(e.Wait))...))
	return ctx
}

// AcquireEnded records the acquisition and ends its span.
func (o *Observer) AcquireEnded(ctx context.Context, e dlock.AcquireEnd) {
	span := trace.SpanFromContext(ctx)
	set := metric.WithAttributeSet(attribute.NewSet(o.attrs(e.Key, e.Mode, WaitKey.Bool(e.Wait), OutcomeKey.String(e.Outcome.String()))...))
	o.acquireDur.Record(ctx, e.Waited.Seconds(), set)
	o.acquisitions.Add(ctx, 1, set)
	if e.Outcome == dlock.Acquired && !e.Reentrant {
		o.held.Add(ctx, 1, metric.WithAttributes(o.attrs(e.Key, e.Mode)...))
	}
	span.SetAttributes(OutcomeKey.String(e.Outcome.String()))
	if e.Outcome == dlock.Acquired {
		span.SetAttributes(fence(e.Fence), ReentrantKey.Bool(e.Reentrant))
	}
	if e.Outcome == dlock.Failed {
		span.RecordError(e.Err)
		span.SetStatus(codes.Error, e.Err.Error())
	}
	span.End()
}

// ReleaseStarted starts the span dlock.release.
func (o *Observer) ReleaseStarted(ctx context.Context, e dlock.ReleaseStart) context.Context {
	ctx, _ = o.tracer.Start(ctx, "dlock.release", trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(o.attrs(e.Key, e.Mode, fence(e.Fence), EndKey.String(endOf(e.Closing)))...))
	return ctx
}

func endOf(closing bool) string {
	if closing {
		return "closed"
	}
	return "released"
}

// ReleaseEnded records the hold and ends the release's span.
func (o *Observer) ReleaseEnded(ctx context.Context, e dlock.ReleaseEnd) {
	o.held.Add(ctx, -1, metric.WithAttributes(o.attrs(e.Key, e.Mode)...))
	o.holdDur.Record(ctx, e.Held.Seconds(), metric.WithAttributes(o.attrs(e.Key, e.Mode, EndKey.String(endOf(e.Closing)))...))
	span := trace.SpanFromContext(ctx)
	if e.Err != nil {
		span.RecordError(e.Err)
		span.SetStatus(codes.Error, e.Err.Error())
	}
	span.End()
}

// Renewed records the renewal's lead.
func (o *Observer) Renewed(e dlock.Renewal) {
	o.renewalLead.Record(context.Background(), e.Lead.Seconds(), metric.WithAttributes(o.attrs(e.Key, e.Mode)...))
}

// Lost records the loss and the hold it ended.
func (o *Observer) Lost(e dlock.Loss) {
	ctx := context.Background()
	o.losses.Add(ctx, 1, metric.WithAttributes(o.attrs(e.Key, e.Mode, CauseKey.String(e.Cause.String()))...))
	o.held.Add(ctx, -1, metric.WithAttributes(o.attrs(e.Key, e.Mode)...))
	o.holdDur.Record(ctx, e.Held.Seconds(), metric.WithAttributes(o.attrs(e.Key, e.Mode, EndKey.String("lost"))...))
}
