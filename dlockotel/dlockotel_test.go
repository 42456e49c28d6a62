package dlockotel_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/dlockotel"
	"github.com/dlock-dev/dlock/memlock"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// sdk is an OpenTelemetry SDK whose metrics and spans a test reads.
type sdk struct {
	reader *sdkmetric.ManualReader
	spans  *tracetest.SpanRecorder
	mp     *sdkmetric.MeterProvider
	tp     *sdktrace.TracerProvider
}

func newSDK(t *testing.T) *sdk {
	s := &sdk{reader: sdkmetric.NewManualReader(), spans: tracetest.NewSpanRecorder()}
	s.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(s.reader))
	s.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(s.spans))
	t.Cleanup(func() {
		_ = s.mp.Shutdown(context.Background())
		_ = s.tp.Shutdown(context.Background())
	})
	return s
}

// locker returns a Locker over b observed through s with opts.
func (s *sdk) locker(t *testing.T, b dlock.Backend, opts ...dlockotel.Option) *dlock.Locker {
	obs, err := dlockotel.New(append([]dlockotel.Option{dlockotel.WithMeterProvider(s.mp), dlockotel.WithTracerProvider(s.tp)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	l := dlock.New(b, &dlock.Options{TTL: dlock.MinTTL, Observer: obs})
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	return l
}

// metric returns the metric called name, failing the test if there is none.
func (s *sdk) metric(t *testing.T, name string) metricdata.Metrics {
	t.Helper()
	m, ok := s.find(t, name)
	if !ok {
		t.Fatalf("no metric %s", name)
	}
	return m
}

func (s *sdk) find(t *testing.T, name string) (metricdata.Metrics, bool) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != dlockotel.ScopeName {
			t.Errorf("scope %q, want %q", sm.Scope.Name, dlockotel.ScopeName)
		}
		for _, m := range sm.Metrics {
			if m.Name == name {
				return m, true
			}
		}
	}
	return metricdata.Metrics{}, false
}

// waitMetric waits (10 s at most) until the metric called name has a data
// point whose count or value is at least 1.
func (s *sdk) waitMetric(t *testing.T, name string) metricdata.Metrics {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if m, ok := s.find(t, name); ok && total(m) > 0 {
			return m
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s within 10 s", name)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// total is the sum of a counter's values or of a histogram's counts.
func total(m metricdata.Metrics) int64 {
	var n int64
	switch d := m.Data.(type) {
	case metricdata.Sum[int64]:
		for _, p := range d.DataPoints {
			n += p.Value
		}
	case metricdata.Histogram[float64]:
		for _, p := range d.DataPoints {
			n += int64(p.Count)
		}
	}
	return n
}

// attrs renders a set as "k=v,k=v", sorted, for comparisons.
func attrs(s attribute.Set) string {
	var out []string
	for _, kv := range s.ToSlice() {
		out = append(out, string(kv.Key)+"="+kv.Value.String())
	}
	slices.Sort(out)
	return strings.Join(out, ",")
}

// sums returns a counter's values by attributes.
func sums(t *testing.T, m metricdata.Metrics) map[string]int64 {
	t.Helper()
	d, ok := m.Data.(metricdata.Sum[int64])
	if !ok {
		t.Fatalf("%s is a %T, want an int64 sum", m.Name, m.Data)
	}
	out := make(map[string]int64)
	for _, p := range d.DataPoints {
		out[attrs(p.Attributes)] = p.Value
	}
	return out
}

// histogram returns a histogram's data points by attributes.
func histogram(t *testing.T, m metricdata.Metrics) map[string]metricdata.HistogramDataPoint[float64] {
	t.Helper()
	d, ok := m.Data.(metricdata.Histogram[float64])
	if !ok {
		t.Fatalf("%s is a %T, want a float64 histogram", m.Name, m.Data)
	}
	if m.Unit != "s" {
		t.Errorf("%s has unit %q, want s", m.Name, m.Unit)
	}
	out := make(map[string]metricdata.HistogramDataPoint[float64])
	for _, p := range d.DataPoints {
		out[attrs(p.Attributes)] = p
	}
	return out
}

func equal[V comparable](t *testing.T, what string, got, want map[string]V) {
	t.Helper()
	for k, w := range want {
		if g, ok := got[k]; !ok || g != w {
			t.Errorf("%s{%s} = %v, want %v (all: %v)", what, k, g, w, got)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s has an unexpected series {%s}: %v", what, k, got)
		}
	}
}

func TestMetricsAndSpans(t *testing.T) {
	ctx := context.Background()
	s := newSDK(t)
	store := memlock.New()
	l := s.locker(t, store)
	other := dlock.New(store, nil)
	defer other.Close(ctx)

	parent, root := s.tp.Tracer("test").Start(ctx, "parent")
	a, err := l.TryAcquire(parent, "a")
	if err != nil {
		t.Fatal(err)
	}
	root.End()
	if _, err := other.TryAcquire(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.TryAcquire(ctx, "b"); !errors.Is(err, dlock.ErrNotAcquired) {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	if _, err := l.Acquire(wctx, "b"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
	cancel()
	if _, err := l.TryAcquire(ctx, "bad\x00key"); !errors.Is(err, dlock.ErrInvalidKey) {
		t.Fatal(err)
	}
	s.waitMetric(t, "dlock.renewal.lead")
	if err := a.Release(ctx); err != nil {
		t.Fatal(err)
	}
	c, err := l.TryAcquire(ctx, "c", dlock.Shared())
	if err != nil {
		t.Fatal(err)
	}
	if err := store.ForceRelease(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	s.waitMetric(t, "dlock.losses")
	<-c.Done()

	const ex, sh = "dlock.mode=exclusive", "dlock.mode=shared"
	acq := map[string]int64{
		ex + ",dlock.outcome=acquired,dlock.wait=false": 1,
		sh + ",dlock.outcome=acquired,dlock.wait=false": 1,
		ex + ",dlock.outcome=conflict,dlock.wait=false": 1,
		ex + ",dlock.outcome=gave_up,dlock.wait=true":   1,
		ex + ",dlock.outcome=error,dlock.wait=false":    1,
	}
	equal(t, "dlock.acquisitions", sums(t, s.metric(t, "dlock.acquisitions")), acq)
	counts := make(map[string]uint64)
	for k, p := range histogram(t, s.metric(t, "dlock.acquire.duration")) {
		counts[k] = p.Count
		if k == ex+",dlock.outcome=gave_up,dlock.wait=true" && p.Sum <= 0 {
			t.Errorf("a wait given up after 50 ms recorded %gs", p.Sum)
		}
	}
	equal(t, "dlock.acquire.duration count", counts, map[string]uint64{
		ex + ",dlock.outcome=acquired,dlock.wait=false": 1,
		sh + ",dlock.outcome=acquired,dlock.wait=false": 1,
		ex + ",dlock.outcome=conflict,dlock.wait=false": 1,
		ex + ",dlock.outcome=gave_up,dlock.wait=true":   1,
		ex + ",dlock.outcome=error,dlock.wait=false":    1,
	})
	equal(t, "dlock.held", sums(t, s.metric(t, "dlock.held")), map[string]int64{ex: 0, sh: 0})
	if d := s.metric(t, "dlock.held").Data.(metricdata.Sum[int64]); d.IsMonotonic {
		t.Error("dlock.held is monotonic, want an up/down counter")
	}
	equal(t, "dlock.losses", sums(t, s.metric(t, "dlock.losses")), map[string]int64{"dlock.loss.cause=not_held," + sh: 1})
	counts = make(map[string]uint64)
	for k, p := range histogram(t, s.metric(t, "dlock.hold.duration")) {
		counts[k] = p.Count
		if k == "dlock.end=released,"+ex && p.Sum < 0.2 {
			t.Errorf("a lock held until its renewal recorded a hold of %gs", p.Sum)
		}
	}
	equal(t, "dlock.hold.duration count", counts, map[string]uint64{"dlock.end=released," + ex: 1, "dlock.end=lost," + sh: 1})
	for k, p := range histogram(t, s.metric(t, "dlock.renewal.lead")) {
		// Renewed at TTL/3, before the safe deadline at TTL − margin.
		lowest, ok := p.Min.Value()
		if k != ex || p.Count < 1 || !ok || lowest <= 0 {
			t.Errorf("dlock.renewal.lead{%s}: count %d, least %g, want leads > 0", k, p.Count, lowest)
		}
	}

	var acquires, releases []sdktrace.ReadOnlySpan
	for _, sp := range s.spans.Ended() {
		switch sp.Name() {
		case "dlock.acquire":
			acquires = append(acquires, sp)
		case "dlock.release":
			releases = append(releases, sp)
		}
	}
	if len(acquires) != 5 || len(releases) != 1 {
		t.Fatalf("%d dlock.acquire and %d dlock.release spans, want 5 and 1", len(acquires), len(releases))
	}
	if acquires[0].Parent().SpanID() != root.SpanContext().SpanID() {
		t.Error("dlock.acquire is not a child of the caller's span")
	}
	for _, sp := range acquires {
		got := attrs(attribute.NewSet(sp.Attributes()...))
		wantErr := strings.Contains(got, "outcome=error")
		if (sp.Status().Code == codes.Error) != wantErr {
			t.Errorf("span %s {%s}: status %v", sp.Name(), got, sp.Status())
		}
		if strings.Contains(got, "outcome=acquired") != strings.Contains(got, "dlock.fence=") {
			t.Errorf("span %s {%s}: a fence exactly when acquired", sp.Name(), got)
		}
		if strings.Contains(got, "dlock.key") {
			t.Errorf("span %s {%s}: a key without WithKeys", sp.Name(), got)
		}
	}
	rel := releases[0]
	if got, want := attrs(attribute.NewSet(rel.Attributes()...)), "dlock.end=released,dlock.fence=1,"+ex; got != want {
		t.Errorf("dlock.release {%s}, want {%s}", got, want)
	}
	if rel.Status().Code != codes.Unset {
		t.Errorf("dlock.release status %v, want unset", rel.Status())
	}
}

func TestKeyAttributes(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name string
		opt  dlockotel.Option
		want string
	}{
		{"WithKeys", dlockotel.WithKeys(), "dlock.key=jobs/nightly"},
		{"WithKeyAttributes", dlockotel.WithKeyAttributes(func(key string) []attribute.KeyValue {
			prefix, _, _ := strings.Cut(key, "/")
			return []attribute.KeyValue{attribute.String("app.lock_group", prefix)}
		}), "app.lock_group=jobs"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := newSDK(t)
			l := s.locker(t, memlock.New(), c.opt)
			k, err := l.TryAcquire(ctx, "jobs/nightly")
			if err != nil {
				t.Fatal(err)
			}
			if err := k.Release(ctx); err != nil {
				t.Fatal(err)
			}
			for _, name := range []string{"dlock.acquisitions", "dlock.held"} {
				for series := range sums(t, s.metric(t, name)) {
					if !strings.Contains(series, c.want) {
						t.Errorf("%s{%s} lacks %s", name, series, c.want)
					}
				}
			}
			for series := range histogram(t, s.metric(t, "dlock.hold.duration")) {
				if !strings.Contains(series, c.want) {
					t.Errorf("dlock.hold.duration{%s} lacks %s", series, c.want)
				}
			}
			for _, sp := range s.spans.Ended() {
				if got := attrs(attribute.NewSet(sp.Attributes()...)); !strings.Contains(got, c.want) {
					t.Errorf("span %s {%s} lacks %s", sp.Name(), got, c.want)
				}
			}
		})
	}
}
