package fence_test

import (
	"context"
	"database/sql"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/fence"
	"github.com/dlock-dev/dlock/memlock"
)

// The database cases run in the backend modules, against real servers
// (locktest.RunFence). These need no server: invalid arguments are refused
// before the nil database or transaction is touched.

func TestInvalidTableIsRefusedBeforeIO(t *testing.T) {
	ctx := context.Background()
	for _, tb := range []fence.Table{
		{},
		{Dialect: fence.Dialect(9)},
		{Dialect: fence.MySQL, Name: "a.b.c"},
		{Dialect: fence.PostgreSQL, Name: "1abc"},
		{Dialect: fence.SQLite, Name: "bad-name"},
		{Dialect: fence.MySQL, Name: "x`; DROP TABLE y; --"},
		{Dialect: fence.PostgreSQL, Name: `s."t"`},
		{Dialect: fence.SQLite, Name: "s."},
		{Dialect: fence.MySQL, Name: strings.Repeat("t", 64)},
	} {
		if err := tb.Migrate(ctx, nil); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%+v: Migrate: got %v, want ErrInvalidOption", tb, err)
		}
		if err := tb.Check(ctx, nil, "r", 1); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%+v: Check: got %v, want ErrInvalidOption", tb, err)
		}
		err := tb.DoTx(ctx, nil, nil, "r", func(context.Context, *sql.Tx) error {
			t.Error("fn ran")
			return nil
		})
		if !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%+v: DoTx: got %v, want ErrInvalidOption", tb, err)
		}
	}
}

func TestInvalidCheckArgumentsAreRefusedBeforeIO(t *testing.T) {
	ctx := context.Background()
	for _, d := range []fence.Dialect{fence.MySQL, fence.PostgreSQL, fence.SQLite} {
		tb := fence.Table{Dialect: d, Name: "app.fences_1"}
		for _, r := range []string{"", strings.Repeat("r", dlock.MaxKeyLen+1), "bad\xff", "nul\x00"} {
			if err := tb.Check(ctx, nil, r, 1); !errors.Is(err, dlock.ErrInvalidKey) {
				t.Errorf("%v: Check(%q): got %v, want ErrInvalidKey", d, r, err)
			}
		}
		for _, f := range []uint64{0, math.MaxInt64 + 1, math.MaxUint64} {
			if err := tb.Check(ctx, nil, "r", f); !errors.Is(err, fence.ErrInvalidFence) {
				t.Errorf("%v: Check(fence %d): got %v, want ErrInvalidFence", d, f, err)
			}
		}
		if err := tb.Check(ctx, nil, "r", 1); !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%v: Check(nil tx): got %v, want ErrInvalidOption", d, err)
		}
	}
}

func TestDoTxWithInvalidKeyAcquiresNothing(t *testing.T) {
	l := dlock.New(memlock.New(), nil)
	defer l.Close(context.Background())
	err := fence.Table{Dialect: fence.SQLite}.DoTx(context.Background(), l, new(sql.DB), "", func(context.Context, *sql.Tx) error {
		t.Error("fn ran")
		return nil
	})
	if !errors.Is(err, dlock.ErrInvalidKey) {
		t.Errorf("DoTx(\"\"): got %v, want ErrInvalidKey", err)
	}
}

func TestDoTxWithoutLockerOrDBIsRefused(t *testing.T) {
	l := dlock.New(memlock.New(), nil)
	defer l.Close(context.Background())
	tb := fence.Table{Dialect: fence.MySQL}
	fn := func(context.Context, *sql.Tx) error { t.Error("fn ran"); return nil }
	for name, err := range map[string]error{
		"nil Locker": tb.DoTx(context.Background(), nil, new(sql.DB), "k", fn),
		"nil DB":     tb.DoTx(context.Background(), l, nil, "k", fn),
		"nil fn":     tb.DoTx(context.Background(), l, new(sql.DB), "k", nil),
	} {
		if !errors.Is(err, dlock.ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", name, err)
		}
	}
}

func TestDialectString(t *testing.T) {
	for d, want := range map[fence.Dialect]string{fence.MySQL: "MySQL", fence.PostgreSQL: "PostgreSQL", fence.SQLite: "SQLite", 0: "Dialect(0)"} {
		if got := d.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", int(d), got, want)
		}
	}
}
