package torture

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/etcdlock"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

// etcdLease is etcdlock on the etcd at Env.EtcdAddr, under a key prefix of
// its own per run ("/torture/<tag>/", emptied by Prepare).
//
// etcd keeps no history to read afterwards (compaction aside, it keeps old
// revisions but no times), so Record watches the prefix from the harness
// (a direct client, not behind a fault proxy) from the revision after
// Prepare, and stamps each watch response with this host's wall clock when
// it arrives. From that feed the history is what etcdlock's layout defines:
// per lock key, the entry with the smallest create revision holds the lock.
// Whenever that entry changes, the old holder's lease ends (its entry was
// deleted: released by its owner, or revoked by etcd at expiry, which look
// alike in the feed) and the new one is granted, with its create revision as
// the fence, at the same instant. A waiter's entry deleted before its turn
// leaves no trace; a waiter that reaches the head is granted at the instant
// its predecessor went, whether or not its client has noticed yet (a grant
// no client reports is counted as unconfirmed).
//
// The end of a lease is modelled as an expiry (ExpUs = AtUs = the delete's
// receive time, Release false), with the grant's ExpUs far in the future (the
// lease lasts until its entry goes; keepalives are not visible in the feed):
//
//   - a release cannot be told from a revocation at expiry, and marking ends
//     as releases would switch off the "kept the lock past the store's end
//     untold" check (checkNotification skips released leases) and time
//     losses against ExpUs rather than the end; as expiries, every lead and
//     every holder's end are measured against the instant etcd let the key
//     go, which is exact for both kinds of end;
//   - the liveness bound is therefore TTL for every end, never TTL + 1 s:
//     etcdlock's waiters queue and watch their predecessor, and the next
//     entry is granted at the very revision that deletes the holder's (a
//     Locker that polls instead, because something hides dlock.Waiter from
//     it, sleeps at most its 1 s backoff, so a wait over TTL then needs a
//     sleep that started within milliseconds of the release);
//   - the store checks of the history (grant while held, expired lease
//     extended) hold by construction (the next grant is the previous end),
//     while the fence check (create revisions increasing per key) and the
//     client-vs-store checks (every fence a worker got was the head entry's
//     create revision; no fence to two acquisitions) are real.
//
// Tokens: the only write to an existing entry is a waiter taking over the
// queue place that the same Backend's previous AcquireWait call parked
// (etcdlock's wait.go), with the new call's token. If the place reached the
// head while parked, the store changes the head's token without a new fence,
// by design: the earlier call reported no acquisition. The grant then carries
// the head entry's last token (the one whose call got the fence) rather than
// being reported as a token swap; that a fence went to one acquisition only
// is checked on the client side (vFenceTwice, vUnknownFence).
//
// Receive times are later than the instants etcd applied the changes by the
// watch's delivery delay: milliseconds on loopback, more when the harness
// process is busy (in 6 CI runs, 263 grants into an empty directory were
// received 0.5 ms before the acquiring worker recorded its acquisition at
// the median, and at most 6 ms after). Every instant of the history is late
// by it, grants and ends alike, so durations measured within the history
// (liveness, free key → next grant) are unbiased, while comparisons with the
// workers' and the resource's clocks are biased towards passing: leads
// (store end − the holder's notice) come out larger by the delay, a holder
// told of the loss (or one that stopped holding) up to that delay after the
// true end is not flagged, fewer resource accesses count as stale, and
// takeovers are timed as having a waiter slightly more often.
//
// The kill/stop takeover target (TTL + 250 ms) is missed by design now and
// then: etcd leases have whole seconds, and the leader revokes expired
// leases every 500 ms, so a crashed or paused holder's key is free 1 to 1.5 s
// after its last renewal (etcdlock's package doc). The misses are counted in
// the report; no check fails on them.
var etcdLease = &Adapter{
	Name:      "etcd-lease",
	Modes:     bothModes,
	Networked: true,
	Upstream:  addrUpstream("Etcd", func(env *Env) string { return env.EtcdAddr }),
	Prepare: func(ctx context.Context, env *Env) (string, error) {
		cli, err := etcdClient(env.EtcdAddr)
		if err != nil {
			return "", err
		}
		defer cli.Close()
		prefix := "/torture/" + env.Tag + "/"
		if _, err := cli.Delete(ctx, prefix, clientv3.WithPrefix()); err != nil {
			return "", fmt.Errorf("etcd-lease prepare: %w", err)
		}
		return prefix, nil
	},
	Open: func(ctx context.Context, a OpenArgs) (dlock.Backend, func() error, error) {
		cli, err := etcdClient(a.Addr)
		if err != nil {
			return nil, nil, err
		}
		// A request without an answer (a blackholed connection) is abandoned
		// and repeated after RequestTimeout; the package doc asks for well
		// below a third of the shortest TTL (the workers' 1 s). Under the
		// latency fault that abandons requests that would have succeeded,
		// which exercises the Backend's repeats.
		b, err := etcdlock.New(cli, &etcdlock.Options{Prefix: a.Store, RequestTimeout: 250 * time.Millisecond})
		if err != nil {
			cli.Close()
			return nil, nil, err
		}
		return b, func() error { b.Close(); return cli.Close() }, nil
	},
	Record: recordEtcd,
	Restart: func(ctx context.Context, env *Env) (int64, int64, error) {
		return restartListener(ctx, env, env.EtcdAddr, etcdReady(env.EtcdAddr), nil)
	},
}

// etcdClient returns a client of the etcd at addr, configured as etcdlock's
// tests configure theirs. Creating it does no I/O.
func etcdClient(addr string) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{
		Endpoints:   []string{addr},
		DialTimeout: 2 * time.Second,
		Logger:      zap.NewNop(),
		// Ping an idle connection so that a dead one is noticed (gRPC raises
		// the interval to its minimum, 10 s; a request without an answer is
		// abandoned sooner, after etcdlock's RequestTimeout).
		DialKeepAliveTime:    time.Second,
		DialKeepAliveTimeout: time.Second,
		// Redial within a fraction of the TTL after an outage (a restart, a
		// cut): gRPC's default backoff (1 s × 1.6 per failure) kept waiters
		// disconnected for seconds after the server was back, and keys free
		// with waiters in line (etcdlock's package doc).
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			MinConnectTimeout: time.Second,
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 250 * time.Millisecond},
		})},
	})
}

// etcdChange is one change the watch reported under the prefix.
type etcdChange struct {
	Rev    int64  `json:"rev"` // the change's revision
	Delete bool   `json:"del,omitempty"`
	Name   string `json:"name"`             // etcd key
	Create int64  `json:"create,omitempty"` // the entry's create revision (for a delete: from its previous value, if known)
	Value  string `json:"value,omitempty"`  // puts
	RecvUs int64  `json:"recv_us"`          // when the harness received it (Unix µs, this host)
}

// recordEtcd watches the prefix store from the revision after Prepare until
// the returned stop is called (see etcdLease).
func recordEtcd(ctx context.Context, env *Env, store string) (*Recording, error) {
	cli, err := etcdClient(env.EtcdAddr)
	if err != nil {
		return nil, err
	}
	resp, err := cli.Get(ctx, store, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		cli.Close()
		return nil, fmt.Errorf("etcd-lease record: %w", err)
	}
	if resp.Count != 0 {
		cli.Close()
		return nil, fmt.Errorf("etcd-lease record: %d keys under %s before the run", resp.Count, store)
	}
	// Without a leader the member would keep the watch open and silent.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	wch := cli.Watch(wctx, store, clientv3.WithPrefix(), clientv3.WithPrevKV(),
		clientv3.WithRev(resp.Header.Revision+1), clientv3.WithCreatedNotify())
	w := &etcdWatch{created: make(chan struct{}), news: make(chan struct{}, 1), done: make(chan struct{})}
	go w.run(wch)
	// Wait until the watch exists, so that no change is received (and
	// stamped) late because the watch was still being set up.
	t := time.NewTimer(10 * time.Second)
	defer t.Stop()
	select {
	case <-w.created:
	case <-w.done:
	case <-t.C:
	}
	if !w.isCreated() {
		cancel()
		<-w.done
		cli.Close()
		return nil, fmt.Errorf("etcd-lease record: watch not created: %v", w.failure())
	}
	// sync writes and deletes the sync mark and waits until the watch has
	// received the deletion: every change before it is then in the record.
	sync := func(ctx context.Context) error {
		if _, err := cli.Put(ctx, etcdSyncMark(store), ""); err != nil {
			return err
		}
		resp, err := cli.Delete(ctx, etcdSyncMark(store))
		if err != nil {
			return err
		}
		return w.waitFor(ctx, resp.Header.Revision, 10*time.Second)
	}
	stop := func(ctx context.Context) ([]LeaseEvent, error) {
		defer cli.Close()
		defer func() { cancel(); <-w.done }()
		end, err := etcdDrain(ctx, cli, store, env.TTL)
		if err != nil {
			return nil, fmt.Errorf("etcd-lease record: %w", err)
		}
		if err := w.waitFor(ctx, end, 10*time.Second); err != nil {
			return nil, fmt.Errorf("etcd-lease record: %w", err)
		}
		cancel()
		<-w.done
		changes := slices.DeleteFunc(w.upTo(end), func(c etcdChange) bool { return c.Name == etcdSyncMark(store) })
		dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_, _ = cli.Delete(dctx, etcdEndMark(store)) // tidy; the next Prepare would remove it
		dcancel()
		if f, err := os.Create(filepath.Join(env.Dir, "etcd-watch.jsonl")); err == nil { // for post-mortems
			enc := json.NewEncoder(f)
			for _, c := range changes {
				_ = enc.Encode(c)
			}
			f.Close()
		}
		hist, live, err := etcdHistory(store, changes)
		if err == nil && live > 0 {
			err = fmt.Errorf("%d entries left in the record, none in etcd: the watch missed deletions", live)
		}
		if err != nil {
			return nil, fmt.Errorf("etcd-lease record: %w", err)
		}
		return hist, nil
	}
	// A restart ends the watch's connection; the client resumes the watch
	// from the revision after the last one received, and sync waits for it.
	return &Recording{Stop: stop, Sync: sync, Restarted: func(ctx context.Context, _ int64) error {
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		for {
			err := sync(sctx)
			if err == nil || w.failure() != nil || sctx.Err() != nil {
				return err
			}
			time.Sleep(100 * time.Millisecond) // the client reconnects
		}
	}}, nil
}

// etcdSyncMark is the key Sync writes (and deletes) under the prefix to
// learn that the watch is up to date; it lies in no lock's directory.
func etcdSyncMark(store string) string { return store + "~sync" }

// etcdEndMark is the key stop writes under the prefix once the run is over:
// its change marks the end of the record. It lies in no lock's directory
// (those end in '/').
func etcdEndMark(store string) string { return store + "~end" }

// etcdDrain waits until no entry is left under store (every worker has
// exited: held and queued entries go with their leases, whole seconds plus
// etcd's 500 ms revocation tick), then writes the end mark and returns its
// revision. Entries still there after ttl + 5 s are an error: their ends
// would be missing from the record.
func etcdDrain(ctx context.Context, cli *clientv3.Client, store string, ttl time.Duration) (int64, error) {
	deadline := time.Now().Add(time.Duration(math.Ceil(ttl.Seconds()))*time.Second + 5*time.Second)
	for {
		resp, err := cli.Get(ctx, store, clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil {
			return 0, err
		}
		if resp.Count == 0 {
			break
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%d entries still under %s after the workers exited", resp.Count, store)
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	resp, err := cli.Put(ctx, etcdEndMark(store), "")
	if err != nil {
		return 0, err
	}
	return resp.Header.Revision, nil
}

// etcdWatch is the receiving side of Record's watch.
type etcdWatch struct {
	created chan struct{} // closed when the watch exists
	news    chan struct{} // a change arrived (or the watch failed)
	done    chan struct{} // run returned

	mu      sync.Mutex
	changes []etcdChange
	lastRev int64 // the revision of the last change received
	err     error // why the watch ended
	isNew   bool  // created was closed
}

// run receives wch until it closes or fails.
func (w *etcdWatch) run(wch clientv3.WatchChan) {
	defer close(w.done)
	for wr := range wch {
		recv := time.Now().UnixMicro()
		if err := wr.Err(); err != nil { // compacted, cancelled by the server, lost leader
			w.fail(err)
			return
		}
		if wr.Created {
			w.mu.Lock()
			if !w.isNew {
				w.isNew = true
				close(w.created)
			}
			w.mu.Unlock()
			continue
		}
		w.mu.Lock()
		for _, ev := range wr.Events {
			c := etcdChange{Rev: ev.Kv.ModRevision, Name: string(ev.Kv.Key), RecvUs: recv}
			if ev.Type == clientv3.EventTypeDelete {
				c.Delete = true
				if ev.PrevKv != nil {
					c.Create = ev.PrevKv.CreateRevision
				}
			} else {
				c.Create, c.Value = ev.Kv.CreateRevision, string(ev.Kv.Value)
			}
			w.changes = append(w.changes, c)
			w.lastRev = max(w.lastRev, c.Rev)
		}
		w.mu.Unlock()
		w.poke()
	}
	w.fail(errors.New("the watch ended"))
}

func (w *etcdWatch) fail(err error) {
	w.mu.Lock()
	if w.err == nil {
		w.err = err
	}
	w.mu.Unlock()
	w.poke()
}

func (w *etcdWatch) poke() {
	select {
	case w.news <- struct{}{}:
	default:
	}
}

func (w *etcdWatch) isCreated() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.isNew
}

func (w *etcdWatch) failure() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// waitFor waits until the change at revision rev has been received. Changes
// arrive in revision order, so the record is then complete up to rev. A
// watch that ended before, for whatever reason, is an error.
func (w *etcdWatch) waitFor(ctx context.Context, rev int64, timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		w.mu.Lock()
		got, err := w.lastRev >= rev, w.err
		w.mu.Unlock()
		switch {
		case got:
			return nil
		case err != nil:
			return fmt.Errorf("watch failed before revision %d: %w", rev, err)
		}
		select {
		case <-w.news:
		case <-t.C:
			return fmt.Errorf("watch not at revision %d after %s", rev, timeout)
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// upTo returns the changes received up to revision rev, without the end
// mark's.
func (w *etcdWatch) upTo(rev int64) []etcdChange {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []etcdChange
	for _, c := range w.changes {
		if c.Rev < rev {
			out = append(out, c)
		}
	}
	return out
}

// liveUntilDeleted is the ExpUs of a grant: the lease lasts until its entry
// goes, which the end event sets. Far in the future, yet small enough for
// the checker's conversion to nanoseconds.
const liveUntilDeleted = math.MaxInt64 / 1000 / 4

// etcdHistory derives the lease history from the changes under prefix (see
// etcdLease): a grant whenever a lock key's oldest entry becomes another one,
// and the end of the previous one's lease at the same instant. It also
// returns how many entries are still live at the end. Changes are replayed in
// revision order, those of one revision in order, each revision as a whole.
// A change the record cannot explain (a key that is not an entry, an entry
// written before the record started, the deletion of an unknown entry) is an
// error: the record would be incomplete.
func etcdHistory(prefix string, changes []etcdChange) ([]LeaseEvent, int, error) {
	type entry struct {
		create int64
		token  [16]byte
		pid    int
	}
	type dir struct {
		entries map[string]*entry // by etcd key
		head    *entry            // holder as of the last revision
		grant   int               // its grant's index in out
	}
	changes = append([]etcdChange(nil), changes...)
	sort.SliceStable(changes, func(i, j int) bool { return changes[i].Rev < changes[j].Rev })
	dirs := map[string]*dir{}
	var keys []string // in order of first appearance, for a stable output
	var out []LeaseEvent
	emit := func(e LeaseEvent) int {
		e.Seq = int64(len(out) + 1)
		out = append(out, e)
		return len(out) - 1
	}
	for i := 0; i < len(changes); {
		j := i
		for j < len(changes) && changes[j].Rev == changes[i].Rev {
			j++
		}
		var touched []string
		recv := int64(0)
		for _, c := range changes[i:j] {
			recv = max(recv, c.RecvUs)
			key, ok := etcdlock.EntryKey(prefix, c.Name)
			if _, mark := etcdlock.MarkKey(prefix, c.Name); !ok && mark {
				continue // a writer mark: no grant (the mode keys' checks do not read this record)
			}
			if !ok {
				return nil, 0, fmt.Errorf("revision %d: %q is not an etcdlock entry under %q", c.Rev, c.Name, prefix)
			}
			d := dirs[key]
			if d == nil {
				d = &dir{entries: map[string]*entry{}}
				dirs[key] = d
				keys = append(keys, key)
			}
			e := d.entries[c.Name]
			switch {
			case c.Delete && e == nil:
				return nil, 0, fmt.Errorf("revision %d: deletion of %q, which the record never saw created", c.Rev, c.Name)
			case c.Delete && c.Create != 0 && c.Create != e.create:
				return nil, 0, fmt.Errorf("revision %d: deletion of %q created at %d, recorded at %d", c.Rev, c.Name, c.Create, e.create)
			case c.Delete:
				delete(d.entries, c.Name)
			case e == nil && c.Create != c.Rev:
				return nil, 0, fmt.Errorf("revision %d: %q was created at %d, before the record", c.Rev, c.Name, c.Create)
			case e != nil && c.Create != e.create:
				return nil, 0, fmt.Errorf("revision %d: %q created at %d, recorded at %d", c.Rev, c.Name, c.Create, e.create)
			default:
				tok, pid, err := etcdToken(c.Value)
				if err != nil {
					return nil, 0, fmt.Errorf("revision %d: %q: %w", c.Rev, c.Name, err)
				}
				if e == nil {
					e = &entry{create: c.Create}
					d.entries[c.Name] = e
				}
				e.token, e.pid = tok, pid
			}
			if !slices.Contains(touched, key) {
				touched = append(touched, key)
			}
		}
		for _, key := range touched {
			d := dirs[key]
			var head *entry
			for _, e := range d.entries {
				if head == nil || e.create < head.create {
					head = e
				}
			}
			if d.head != nil && head != d.head {
				for _, e := range d.entries {
					if e == d.head {
						return nil, 0, fmt.Errorf("revision %d: %s: holder %d superseded by %d while still there", changes[i].Rev, key, d.head.create, head.create)
					}
				}
				g := out[d.grant]
				emit(LeaseEvent{Key: key, Fence: g.Fence, Token: g.Token, AtUs: recv, ExpUs: recv, Pid: g.Pid})
			}
			if head != nil && head != d.head {
				d.grant = emit(LeaseEvent{Key: key, Fence: uint64(head.create), Token: head.token, AtUs: recv, ExpUs: liveUntilDeleted, Pid: head.pid})
			} else if head != nil {
				out[d.grant].Token = head.token // a parked place taken over (see etcdLease)
			}
			d.head = head
		}
		i = j
	}
	live := 0
	for _, k := range keys {
		live += len(dirs[k].entries)
	}
	return out, live, nil
}

// etcdToken reads the token of an entry's JSON value, and the pid in its
// metadata (0 if none).
func etcdToken(value string) ([16]byte, int, error) {
	var tok [16]byte
	var v struct {
		Token    string `json:"token"`
		Metadata string `json:"metadata"`
	}
	if err := json.Unmarshal([]byte(value), &v); err != nil {
		return tok, 0, fmt.Errorf("entry value: %w", err)
	}
	b, err := hex.DecodeString(v.Token)
	if err != nil || len(b) != len(tok) {
		return tok, 0, fmt.Errorf("entry token %q: not 16 bytes in hex", v.Token)
	}
	copy(tok[:], b)
	return tok, metadataPid(v.Metadata), nil
}
