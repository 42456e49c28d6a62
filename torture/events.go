package torture

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"sync"
)

// Event is one line of a worker's record (JSON lines, one file per worker
// process). Times are Mono() nanoseconds.
type Event struct {
	T  int64  `json:"t"`            // when the event ended (or happened)
	T0 int64  `json:"t0,omitempty"` // when the call started
	Ev string `json:"ev"`           // start, acq, acqerr, done, op, skip, rel, dofree, slow, obs, exit
	K  string `json:"k,omitempty"`  // key
	F  uint64 `json:"f,omitempty"`  // fence
	// op: "r" (read, which also presents the token to the resource) or "w".
	Op string `json:"op,omitempty"`
	// OK: the resource accepted the op. For done: the lock was lost (as
	// opposed to released or closed).
	OK   bool   `json:"ok,omitempty"`
	Err  string `json:"err,omitempty"`
	V    int64  `json:"v,omitempty"`    // value read
	Plan int64  `json:"plan,omitempty"` // acq: planned hold, ns
	Pid  int    `json:"pid,omitempty"`  // start
	W    string `json:"w,omitempty"`    // start: worker id
	Pool int    `json:"pool,omitempty"` // start: the store pool's size, if the smallpool fault set it
	// Cf: the client fault of the call (acq, acqerr, rel; see client.go).
	Cf string `json:"cf,omitempty"`
	// Dl: the caller's deadline of a call with a deadline fault (Mono()).
	Dl int64 `json:"dl,omitempty"`
	// Chk (op): the lock's Err was nil when asked at or after this instant,
	// just before the access.
	Chk int64 `json:"chk,omitempty"`
	// Tok (slow acquire and wait): the owner token of the call's request
	// (hex), which names the worker behind a grant no worker was told of.
	Tok string `json:"tok,omitempty"`
	// M (acq, op): the mode of the lock, accessShared or accessLimited;
	// empty for an exclusive lock. N (acq): the limit of a limited lock.
	M string `json:"m,omitempty"`
	N int    `json:"n,omitempty"`
	// Val (obs): the leader's value an Election observer reported.
	Val string `json:"val,omitempty"`
}

// recorder appends events to a worker's file. Each event is one write(2), so
// a SIGKILL never leaves half a line behind.
type recorder struct {
	mu sync.Mutex
	f  *os.File
}

func newRecorder(path string) (*recorder, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	return &recorder{f: f}, nil
}

func (r *recorder) rec(e Event) {
	if e.T == 0 {
		e.T = Mono()
	}
	b, _ := json.Marshal(e)
	b = append(b, '\n')
	r.mu.Lock()
	_, _ = r.f.Write(b)
	r.mu.Unlock()
}

func (r *recorder) close() error { return r.f.Close() }

// readEvents reads a worker's file. A malformed line is reported (a
// truncated last line is only possible if the machine itself crashed).
func readEvents(path string) ([]Event, int, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	var evs []Event
	bad := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var e Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			bad++
			continue
		}
		evs = append(evs, e)
	}
	if err := sc.Err(); err != nil {
		return evs, bad, fmt.Errorf("read %s: %w", path, err)
	}
	return evs, bad, nil
}
