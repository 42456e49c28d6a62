package dlockotel_test

import (
	"context"
	"fmt"
	"log"
	"strings"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/dlockotel"
	"github.com/dlock-dev/dlock/memlock"
	"github.com/prometheus/client_golang/prometheus"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
)

// A Locker's metrics exported to Prometheus. A server would serve the
// registry with promhttp.HandlerFor; here it is gathered once.
func Example_prometheus() {
	ctx := context.Background()
	registry := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(registry))
	if err != nil {
		log.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	defer mp.Shutdown(ctx)

	obs, err := dlockotel.New(dlockotel.WithMeterProvider(mp))
	if err != nil {
		log.Fatal(err)
	}
	locker := dlock.New(memlock.New(), &dlock.Options{Observer: obs})
	defer locker.Close(ctx)
	if err := locker.Do(ctx, "reports/nightly", func(ctx context.Context) error { return nil }); err != nil {
		log.Fatal(err)
	}

	families, err := registry.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range families {
		if !strings.HasPrefix(f.GetName(), "dlock_") {
			continue
		}
		for _, m := range f.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				if !strings.HasPrefix(lp.GetName(), "otel_") {
					labels = append(labels, lp.GetName()+"="+lp.GetValue())
				}
			}
			switch {
			case m.GetCounter() != nil:
				fmt.Println(f.GetName(), labels, m.GetCounter().GetValue())
			case m.GetGauge() != nil:
				fmt.Println(f.GetName(), labels, m.GetGauge().GetValue())
			case m.GetHistogram() != nil:
				fmt.Println(f.GetName(), labels, "count", m.GetHistogram().GetSampleCount())
			}
		}
	}
	// Output:
	// dlock_acquire_duration_seconds [dlock_mode=exclusive dlock_outcome=acquired dlock_wait=true] count 1
	// dlock_acquisitions_total [dlock_mode=exclusive dlock_outcome=acquired dlock_wait=true] 1
	// dlock_held [dlock_mode=exclusive] 0
	// dlock_hold_duration_seconds [dlock_end=released dlock_mode=exclusive] count 1
}
