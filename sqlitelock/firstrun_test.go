package sqlitelock_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/sqlitelock"
)

// Environment of the first-run helper processes.
const (
	envFirstRunFile = "DLOCK_SQLITE_FIRSTRUN_DB"
	envFirstRunGo   = "DLOCK_SQLITE_FIRSTRUN_GO"
)

// firstRunProcs is how many processes start on one fresh file at once: a
// host's cron jobs that start in the same second.
const firstRunProcs = 16

// TestConcurrentFirstRun starts firstRunProcs processes that open one file
// that does not exist yet, Migrate it and try the same key at the same
// instant. Every one must get an answer: exactly one holds the key, the
// others are told it is taken; none fails (SQLITE_BUSY from the WAL switch
// or the schema creation is a failure).
func TestConcurrentFirstRun(t *testing.T) {
	if os.Getenv(envFirstRunFile) != "" {
		firstRunHelper()
		return
	}
	dir := t.TempDir()
	path, start := filepath.Join(dir, "state", "locks.db"), filepath.Join(dir, "go")
	type proc struct {
		cmd *exec.Cmd
		out bytes.Buffer
	}
	procs := make([]*proc, firstRunProcs)
	for i := range procs {
		p := &proc{cmd: exec.Command(os.Args[0], "-test.run=^TestConcurrentFirstRun$", "-test.count=1", "-test.timeout=120s")}
		p.cmd.Env = append(os.Environ(), envFirstRunFile+"="+path, envFirstRunGo+"="+start)
		p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
		if err := p.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		procs[i] = p
	}
	// Each helper says it is ready with a file of its own, then waits for
	// the start file: they all leave the barrier within a few ms.
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		ready, _ := filepath.Glob(filepath.Join(dir, "ready-*"))
		if len(ready) == firstRunProcs {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d processes ready after 60 s", len(ready), firstRunProcs)
		}
	}
	if err := os.WriteFile(start, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	held, taken := 0, 0
	for i, p := range procs {
		err := p.cmd.Wait()
		out := p.out.String()
		switch {
		case err != nil:
			t.Errorf("process %d: %v: %s", i, err, out)
		case strings.Contains(out, "RESULT held"):
			held++
		case strings.Contains(out, "RESULT taken"):
			taken++
		default:
			t.Errorf("process %d said nothing: %s", i, out)
		}
	}
	if held != 1 && !t.Failed() {
		t.Errorf("%d processes hold the key, %d were told it is taken; want exactly one holder", held, taken)
	}
}

// firstRunHelper runs in a helper process: it waits for the start file,
// then opens, migrates and tries the key, prints the outcome and exits
// without releasing (the lease outlives the test).
func firstRunHelper() {
	err := firstRun(os.Getenv(envFirstRunFile), os.Getenv(envFirstRunGo))
	if err != nil {
		fmt.Printf("ERROR %v\n", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func firstRun(path, start string) error {
	ready := filepath.Join(filepath.Dir(start), fmt.Sprintf("ready-%d", os.Getpid()))
	if err := os.WriteFile(ready, nil, 0o600); err != nil {
		return err
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		if _, err := os.Stat(start); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("no start signal")
		}
		time.Sleep(time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b, err := sqlitelock.Open(path)
	if err != nil {
		return err
	}
	if err := b.Migrate(ctx); err != nil {
		return err
	}
	l := dlock.New(b, nil)
	lk, err := l.TryAcquire(ctx, "first-run", dlock.WithTTL(time.Minute))
	switch {
	case errors.Is(err, dlock.ErrNotAcquired):
		fmt.Println("RESULT taken")
		return nil
	case err != nil:
		return err
	}
	fmt.Printf("RESULT held %d\n", lk.Fence())
	return nil
}
