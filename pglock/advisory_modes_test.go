package pglock_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/locktest"
	"github.com/dlock-dev/dlock/pglock"
)

// TestMigrateUpgradesV1SessionTable: the advisory strategy's fencing row of
// the previous schema goes on after Migrate, in either mode.
func TestMigrateUpgradesV1SessionTable(t *testing.T) {
	ctx := t.Context()
	pool, table := v1Tables(t)
	key, tok := "upgrade/advisory", dlock.NewToken()
	k1, k2 := pglock.AdvisoryKeys(key)
	if _, err := pool.Exec(ctx, `INSERT INTO "`+table+`_session" (name, lock_id, token, owner, fence, pid, acquired_at, metadata)
  VALUES ($1, $2, $3, '', 5, 0, clock_timestamp(), '')`, []byte(key), int64(uint32(k1))<<32|int64(uint32(k2)), tok[:]); err != nil {
		t.Fatal(err)
	}
	a, err := pglock.NewAdvisory(pool, &pglock.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.Migrate(ctx); err != nil {
		t.Fatalf("Migrate of the previous schema: %v", err)
	}
	// Fences are epoch<<40 | n from then on (see Advisory).
	f := mustGrant(t, a, req(key, time.Minute, dlock.ModeShared, 0))
	if f <= 5 {
		t.Errorf("rule: fences go on after the upgrade; shared fence %d after 5", f)
	}
	if g := mustGrant(t, a, req(key+"/2", time.Minute, dlock.ModeExclusive, 0)); g != f>>40<<40+1 {
		t.Errorf("a new key's first fence: %#x, want the epoch's first, %#x", g, f>>40<<40+1)
	}
}

// TestAdvisoryWriterMark: an exclusive try that finds readers leaves the
// writer mark, which refuses new readers before the writer waits in the
// server (where PostgreSQL's own queue takes over); the writer's grant
// clears it.
func TestAdvisoryWriterMark(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("advmark")
	readers, writer, late := newAdvisory(t, nil), newAdvisory(t, nil), newAdvisory(t, nil)
	r := req(key, time.Minute, dlock.ModeShared, 0)
	f := mustGrant(t, readers, r)
	w := req(key, time.Minute, dlock.ModeExclusive, 0)
	if res := mustRefuse(t, writer, w, "readers exclude a writer"); res.Holder.Mode != dlock.ModeShared || res.Holder.Token != r.Token {
		t.Errorf("the writer's refusal names %+v, want the reader", res.Holder)
	}
	res := mustRefuse(t, late, req(key, time.Minute, dlock.ModeShared, 0), "a writer that found readers keeps new readers out")
	if res.Remaining <= 0 || res.Remaining > dlock.WriterMark {
		t.Errorf("the refused reader's Remaining %s, want the writer mark's", res.Remaining)
	}
	if err := readers.Release(ctx, key, r.Token); err != nil {
		t.Fatal(err)
	}
	wf := mustGrant(t, writer, w)
	if wf <= f {
		t.Errorf("rule: fences increase across modes; the writer's %d after the reader's %d", wf, f)
	}
	if err := writer.Release(ctx, key, w.Token); err != nil {
		t.Fatal(err)
	}
	mustGrant(t, late, req(key, time.Minute, dlock.ModeShared, 0)) // rule: an exclusive grant clears the mark
}

// TestAdvisorySharedHoldsInOneProcess: one Advisory holds a key shared
// twice (the second on a session of its own: a session holds a key once),
// refuses an exclusive request for it (a grant on the session that holds it
// shared would be re-entrant), lists both readers, and frees the key when
// both are released.
func TestAdvisorySharedHoldsInOneProcess(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("advtwice")
	a := newAdvisory(t, nil)
	r1, r2 := req(key, time.Minute, dlock.ModeShared, 0), req(key, time.Minute, dlock.ModeShared, 0)
	f1 := mustGrant(t, a, r1)
	if f2 := mustGrant(t, a, r2); f2 <= f1 {
		t.Errorf("fences %d then %d", f1, f2)
	}
	mustRefuse(t, a, req(key, time.Minute, dlock.ModeExclusive, 0), "readers of this process exclude its writers")
	infos, err := a.List(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != 2 || infos[0].Mode != dlock.ModeShared || infos[1].Mode != dlock.ModeShared ||
		infos[0].Token != r1.Token || infos[1].Token != r2.Token {
		t.Errorf("List: %+v, want both readers", infos)
	}
	for _, r := range []dlock.Request{r1, r2} {
		if err := a.Release(ctx, key, r.Token); err != nil {
			t.Fatal(err)
		}
	}
	w := req(key, time.Minute, dlock.ModeExclusive, 0)
	mustGrant(t, a, w)
	if err := a.Release(ctx, key, w.Token); err != nil {
		t.Fatal(err)
	}
	if counts, n := pglock.SessionCounts(a); n != 0 {
		t.Errorf("%d holds left on the books (sessions: %v)", n, counts)
	}
	if _, err := a.Acquire(ctx, req(key, time.Minute, dlock.ModeLimited, 2)); !errors.Is(err, dlock.ErrUnsupported) {
		t.Errorf("a limited request: %v, want ErrUnsupported", err)
	}
}

// TestAdvisoryReaderBehindMarkGetsInAfterTheWriter: a reader that meets
// the writer mark while the writer waits for the key gets in soon after
// the writer has had the key and left, well before the mark (which lasts
// dlock.WriterMark from the writer's try) would have ended: the writer's
// grant clears the mark, and the reader asks again within a short bound
// rather than sleeping out the mark.
func TestAdvisoryReaderBehindMarkGetsInAfterTheWriter(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("advrecheck")
	readers, writer := newAdvisory(t, nil), newAdvisory(t, nil)
	r1 := req(key, time.Minute, dlock.ModeShared, 0)
	mustGrant(t, readers, r1)
	w := req(key, time.Minute, dlock.ModeExclusive, 0)
	mustRefuse(t, writer, w, "a reader excludes a writer") // leaves the mark
	tried := time.Now()
	type outcome struct {
		at  time.Time
		err error
	}
	writerLeft := make(chan outcome, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		res, err := writer.AcquireWait(wctx, w)
		if err == nil && !res.Acquired {
			err = errors.New("the writer's wait ended without the key")
		}
		if err == nil {
			err = writer.Release(context.Background(), key, w.Token)
		}
		writerLeft <- outcome{time.Now(), err}
	}()
	r2 := locktest.NewLocker(t, newAdvisory(t, nil))
	readerIn := make(chan outcome, 1)
	go func() {
		rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		lk, err := r2.Acquire(rctx, key, dlock.Shared())
		at := time.Now()
		if err == nil {
			err = lk.Release(context.Background())
		}
		readerIn <- outcome{at, err}
	}()
	// Time for the reader's first attempt, which meets the mark.
	time.Sleep(300 * time.Millisecond)
	if err := readers.Release(ctx, key, r1.Token); err != nil {
		t.Fatal(err)
	}
	wl := <-writerLeft
	if wl.err != nil {
		t.Fatal(wl.err)
	}
	ri := <-readerIn
	if ri.err != nil {
		t.Fatalf("the reader: %v", ri.err)
	}
	const bound = time.Second
	if d := ri.at.Sub(wl.at); d > bound || ri.at.Sub(tried) > dlock.WriterMark-bound {
		t.Errorf("rule: a reader that met the writer mark gets in once the writer has left; it got in %s after the writer left, %s after the writer's try (the mark lasts %s), want <= %s after",
			d, ri.at.Sub(tried), dlock.WriterMark, bound)
	}
}

// TestAdvisoryWaitBoundedInServer: an exclusive wait in the server ends by
// itself, at lock_timeout, as "not acquired yet" (no error): its session
// and the Advisory's other locks go on, the writer mark is renewed to keep
// readers out until the writer waits again, and the next wait is granted
// by the readers' release.
func TestAdvisoryWaitBoundedInServer(t *testing.T) {
	ctx := t.Context()
	key := locktest.UniqueKey("advbound")
	readers, writer, late := newAdvisory(t, nil), newAdvisory(t, nil), newAdvisory(t, nil)
	r := req(key, time.Minute, dlock.ModeShared, 0)
	mustGrant(t, readers, r)
	other := req(key+"/other", time.Minute, dlock.ModeExclusive, 0)
	mustGrant(t, writer, other)
	w := req(key, time.Minute, dlock.ModeExclusive, 0)
	mustRefuse(t, writer, w, "readers exclude a writer")
	tried := time.Now() // the try's mark ends before tried + dlock.WriterMark
	wctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	res, err := writer.AcquireWait(wctx, w)
	if err != nil || res.Acquired {
		t.Fatalf("AcquireWait while readers hold: %+v, %v; want not acquired, no error", res, err)
	}
	if d := time.Since(tried); d > 15*time.Second {
		t.Fatalf("rule: a wait in the server is bounded there; AcquireWait returned after %s", d.Round(time.Millisecond))
	}
	asked := time.Now()
	lr := mustRefuse(t, late, req(key, time.Minute, dlock.ModeShared, 0), "a writer between two waits keeps new readers out")
	if !asked.Add(lr.Remaining).After(tried.Add(dlock.WriterMark)) {
		t.Errorf("rule: a wait that reached its bound renews the writer mark; the mark has %s left", lr.Remaining)
	}
	if errs, _ := writer.Extend(ctx, []dlock.Lease{{Key: other.Key, Token: other.Token, TTL: time.Minute}}); errs[0] != nil {
		t.Fatalf("rule: a wait that reached its bound ends no session; the other lock: %v", errs[0])
	}
	got := make(chan error, 1)
	go func() {
		res, err := writer.AcquireWait(wctx, w)
		if err == nil && !res.Acquired {
			err = errors.New("not acquired")
		}
		got <- err
	}()
	waitsInServer(t, key)
	if err := readers.Release(ctx, key, r.Token); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the writer waiting again was not granted the readers' release: %v", err)
	}
	if err := writer.Release(ctx, key, w.Token); err != nil {
		t.Fatal(err)
	}
	if err := writer.Release(ctx, other.Key, other.Token); err != nil {
		t.Fatal(err)
	}
}

// TestAdvisoryWriterWaitingAgainGoesFirst: a writer whose waits in the
// server reach their bound again and again (readers hold for longer) keeps
// its turn: a reader that waits after it gets the key only after the
// writer had it.
func TestAdvisoryWriterWaitingAgainGoesFirst(t *testing.T) {
	if testing.Short() {
		t.Skip("waits 8 s")
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	key := locktest.UniqueKey("advagain")
	rl, wl, ll := dlock.New(newAdvisory(t, nil), nil), dlock.New(newAdvisory(t, nil), nil), dlock.New(newAdvisory(t, nil), nil)
	for _, l := range []*dlock.Locker{rl, wl, ll} {
		defer l.Close(context.Background())
	}
	r, err := rl.TryAcquire(ctx, key, dlock.Shared(), dlock.WithTTL(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	order := make(chan string, 2)
	errs := make(chan error, 2)
	take := func(l *dlock.Locker, who string, opts ...dlock.AcquireOption) {
		lk, err := l.Acquire(ctx, key, opts...)
		if err == nil {
			order <- who
			time.Sleep(100 * time.Millisecond)
			err = lk.Release(context.Background())
		}
		errs <- err
	}
	go take(wl, "writer")
	waitsInServer(t, key)
	go take(ll, "reader", dlock.Shared())
	time.Sleep(8 * time.Second) // past three bounds of the writer's wait
	select {
	case who := <-order:
		t.Fatalf("the %s got the key while the first reader held it", who)
	default:
	}
	if err := r.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if first := <-order; first != "writer" {
		t.Errorf("rule: readers that come after a waiting writer do not pass it; the %s went first", first)
	}
}

// waitsInServer returns once a session waits in the server for key's
// advisory lock exclusively.
func waitsInServer(t *testing.T, key string) {
	t.Helper()
	admin := open(t, "")
	k1, k2 := pglock.AdvisoryKeys(key)
	for i := 0; ; i++ {
		var n int
		err := admin.QueryRow(t.Context(), `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
  AND mode = 'ExclusiveLock' AND objsubid = 2 AND classid = $1::int4::oid AND objid = $2::int4::oid`, k1, k2).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n > 0 {
			return
		}
		if i == 1000 {
			t.Fatal("no exclusive request waited in the server")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAdvisoryExclusiveWaitKeepsItsPlace: an exclusive wait that starts
// while the key has no readers is not ended at the short bound of a wait
// among readers: it keeps its place in the server's queue.
func TestAdvisoryExclusiveWaitKeepsItsPlace(t *testing.T) {
	if testing.Short() {
		t.Skip("waits 5 s")
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	key := locktest.UniqueKey("advplace")
	hl, wl := dlock.New(newAdvisory(t, nil), nil), dlock.New(newAdvisory(t, nil), nil)
	defer hl.Close(context.Background())
	defer wl.Close(context.Background())
	h, err := hl.TryAcquire(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		lk, err := wl.Acquire(ctx, key)
		if err == nil {
			err = lk.Release(context.Background())
		}
		got <- err
	}()
	waitsInServer(t, key)
	admin := open(t, "")
	k1, k2 := pglock.AdvisoryKeys(key)
	waiting := func() (pid int32, since time.Time) {
		t.Helper()
		err := admin.QueryRow(ctx, `SELECT a.pid, a.query_start FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objsubid = 2 AND l.classid = $1::int4::oid AND l.objid = $2::int4::oid`, k1, k2).Scan(&pid, &since)
		if err != nil {
			t.Fatal(err)
		}
		return pid, since
	}
	pid, since := waiting()
	time.Sleep(5 * time.Second) // past two short bounds
	if pid2, since2 := waiting(); pid2 != pid || !since2.Equal(since) {
		t.Errorf("rule: a writer's wait without readers keeps its place; the wait of %d since %s is now %d's since %s", pid, since, pid2, since2)
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}
