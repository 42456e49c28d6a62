package sqlitelock_test

import (
	"context"
	"database/sql"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/sqlitelock"
)

// onNewFile opens a migrated Backend on a new file in the test's directory.
func onNewFile(t *testing.T) (string, dlock.Backend) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "locks.db")
	b := sqliteOpen(t, path)
	if err := b.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return path, b
}

// TestGrantAfterAWaitForTheWriteLock: an acquisition of a free key that
// waits most of its TTL for the file's write lock (another process writes)
// is granted, exclusive as shared: the store times the lease from after the
// wait, and says so.
func TestGrantAfterAWaitForTheWriteLock(t *testing.T) {
	path, b := onNewFile(t)
	ctx := context.Background()
	l := dlock.New(b, &dlock.Options{TTL: time.Second})
	defer l.Close(ctx)
	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_txlock=immediate")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	for _, c := range []struct {
		name string
		opts []dlock.AcquireOption
	}{{"shared", []dlock.AcquireOption{dlock.Shared()}}, {"exclusive", nil}} {
		tx, err := other.Begin()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec("CREATE TABLE IF NOT EXISTS app (x)"); err != nil {
			t.Fatal(err)
		}
		ended := make(chan struct{})
		go func() { time.Sleep(900 * time.Millisecond); tx.Rollback(); close(ended) }()
		began := time.Now()
		lk, err := l.TryAcquire(ctx, "free-"+c.name, c.opts...)
		<-ended
		if err != nil {
			t.Errorf("%s acquisition of a free key after a %s wait for the write lock: %v", c.name, time.Since(began).Round(time.Millisecond), err)
			continue
		}
		if d := time.Until(lk.Deadline()); d > time.Second {
			t.Errorf("%s: the safe deadline is %s away, beyond the TTL", c.name, d)
		}
		lk.Release(ctx)
	}
}

// holdInNewFile deletes the database file at path, makes a new one there
// through a Backend of its own, and holds key in it until the test ends.
func holdInNewFile(t *testing.T, path, key string) *dlock.Lock {
	t.Helper()
	ctx := context.Background()
	for _, suffix := range []string{"", "-wal", "-shm"} {
		if err := os.Remove(path + suffix); err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Fatal(err)
		}
	}
	b := sqliteOpen(t, path)
	if err := b.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	l := dlock.New(b, nil)
	t.Cleanup(func() { l.Close(ctx) })
	k, err := l.TryAcquire(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestReplacedFile: a database file deleted and made again (a restored
// backup, a deploy that recreates it) while a lock is held gives the key's
// next holder a larger fence than the old holder's, and the old holder is
// told of its loss at its next renewal.
func TestReplacedFile(t *testing.T) {
	path, b := onNewFile(t)
	ctx := context.Background()
	l := dlock.New(b, &dlock.Options{TTL: 3 * time.Second})
	defer l.Close(ctx)
	var old *dlock.Lock
	for i := range 5 {
		k, err := l.Acquire(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		if i < 4 {
			k.Release(ctx)
		}
		old = k
	}
	k := holdInNewFile(t, path, "k")
	t.Logf("fences: old %d, new %d", old.Fence(), k.Fence())
	if k.Fence() <= old.Fence() {
		t.Errorf("rule: fences grow per key; the new file's holder got %d, the old file's holds %d", k.Fence(), old.Fence())
	}
	select {
	case <-old.Done():
	case <-time.After(3 * time.Second):
		t.Errorf("the old file's holder was not told within its TTL; Err: %v", old.Err())
	}
}

// TestReplacedBeforeFirstUse: a file replaced after Open and Migrate, before
// any lock was taken, is noticed too: the Backend refuses to grant in it.
func TestReplacedBeforeFirstUse(t *testing.T) {
	path, b := onNewFile(t)
	ctx := context.Background()
	holdInNewFile(t, path, "k") // the new file's holder
	l := dlock.New(b, nil)
	defer l.Close(ctx)
	if k1, err := l.TryAcquire(ctx, "k"); !errors.Is(err, sqlitelock.ErrFileReplaced) {
		if err == nil {
			k1.Release(ctx)
		}
		t.Errorf("rule: a Backend whose file was replaced grants nothing; got %v, want ErrFileReplaced", err)
	}
}
