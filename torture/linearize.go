package torture

import (
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"
)

// The linearizability check: the resource as the workers saw it, judged by
// porcupine without the resource's own log. checkResource replays that log,
// which the server wrote in commit order; this check trusts only what each
// worker observed and when (its monotonic call and return instants), so a
// defect in the log, in its replay, or in the harness's bookkeeping cannot
// hide a violation from both.
//
// The specification is the one a lock promises its holder: each work cycle —
// read the key's counter (value v), compute, write v+1 — happens atomically.
// As porcupine operations, per key:
//   - a cycle whose read and write were both accepted: one operation from
//     the read's call to the write's return, valid only when the counter is
//     v, which it sets to v+1;
//   - an accepted read whose write was refused (a stale holder, fenced out):
//     the read alone, valid when the counter is v, changing nothing;
//   - an accepted read whose write's outcome is unknown (the write failed,
//     or the worker died after the read): the read alone as above, plus a
//     write still pending at the end of the history that either never took
//     effect or took the counter from v to v+1;
//   - refused and failed reads show nothing about the counter and are left
//     out.
//
// With fencing every accepted write follows its own read with no accepted
// access of another holder in between, so a correct run is linearizable; a
// lost update (two holders both reading v and writing v+1, the positive
// control's pauses) is not.

// vNotLinearizable is the violation this check reports; like the other
// resource kinds it is what the positive control must produce.
const vNotLinearizable = "resource: not linearizable as the workers saw it (porcupine)"

// linearizeTimeout bounds porcupine's search; a search cut short is
// reported inconclusive, never as a pass.
const linearizeTimeout = 60 * time.Second

// cycleInput is a porcupine operation's input: the value read, and what
// became of the write.
type cycleInput struct {
	key   string
	v     int64
	write writeOutcome
}

type writeOutcome int

const (
	readOnly     writeOutcome = iota // no write took effect
	wrote                            // the write of v+1 was accepted
	pendingWrite                     // a write whose outcome is unknown (see above)
)

// counterModel is the atomic-cycle specification (see above) for one key.
var counterModel = porcupine.NondeterministicModel{
	Init: func() []any { return []any{int64(0)} },
	Step: func(state, input, _ any) []any {
		s, in := state.(int64), input.(cycleInput)
		switch in.write {
		case pendingWrite:
			if s == in.v {
				return []any{s, s + 1}
			}
			return []any{s} // it never took effect
		case wrote:
			if s == in.v {
				return []any{s + 1}
			}
		default:
			if s == in.v {
				return []any{s}
			}
		}
		return nil
	},
	Equal: func(a, b any) bool { return a.(int64) == b.(int64) },
	DescribeOperation: func(input, _ any) string {
		in := input.(cycleInput)
		return fmt.Sprintf("%s read %d, write %s", in.key, in.v, [...]string{"refused", "accepted", "pending"}[in.write])
	},
}

// cycles turns the workers' records into porcupine operations (see above).
// end is the instant pending writes stay open until; with fencing, a pending
// write closes at the return of the first accepted read of its key with a
// larger token, after which the resource refuses it (a write that took
// effect later anyway is a fencing failure, and shows as not linearizable).
// Each pending write left open doubles porcupine's search on a key.
func cycles(workers []*workerLog, end int64, fenced bool) []porcupine.Operation {
	var ops []porcupine.Operation
	for ci, w := range workers {
		// The accepted read awaiting its write, per key: a worker's lanes
		// hold different keys at once, each its own sequence of cycles.
		reads := map[string]*Event{}
		flush := func(k string) { // the worker never recorded the read's write
			if read := reads[k]; read != nil {
				ops = append(ops,
					porcupine.Operation{ClientId: ci, Input: cycleInput{read.K, read.V, readOnly}, Call: read.T0, Return: read.T},
					porcupine.Operation{ClientId: ci, Input: cycleInput{read.K, read.V, pendingWrite}, Call: read.T, Return: end, Metadata: read.F})
				delete(reads, k)
			}
		}
		for i := range w.Events {
			e := &w.Events[i]
			if e.Ev != "op" && e.Ev != "skip" {
				continue
			}
			read := reads[e.K]
			switch {
			case e.Op == "r":
				flush(e.K)
				if e.OK && e.Err == "" {
					reads[e.K] = e
				}
			case read == nil:
				// A write without its read in the record cannot happen; an
				// unmatched one shows nothing checkable.
			case e.Ev == "skip":
				// The worker saw the lock lost and did not write.
				ops = append(ops, porcupine.Operation{ClientId: ci, Input: cycleInput{read.K, read.V, readOnly}, Call: read.T0, Return: read.T})
				delete(reads, e.K)
			case e.Err != "":
				flush(e.K)
			case e.OK:
				ops = append(ops, porcupine.Operation{ClientId: ci, Input: cycleInput{read.K, read.V, wrote}, Call: read.T0, Return: e.T})
				delete(reads, e.K)
			default:
				ops = append(ops, porcupine.Operation{ClientId: ci, Input: cycleInput{read.K, read.V, readOnly}, Call: read.T0, Return: read.T})
				delete(reads, e.K)
			}
		}
		keys := make([]string, 0, len(reads))
		for k := range reads {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			flush(k)
		}
	}
	if fenced {
		closePending(workers, ops)
	}
	return ops
}

// closePending closes each pending write at the return of the first
// accepted read of its key with a larger token that returned after the
// write's read (see cycles).
func closePending(workers []*workerLog, ops []porcupine.Operation) {
	type read struct {
		t int64
		f uint64
	}
	reads := map[string][]read{}
	for _, w := range workers {
		for _, e := range w.Events {
			if e.Ev == "op" && e.Op == "r" && e.OK && e.Err == "" {
				reads[e.K] = append(reads[e.K], read{e.T, e.F})
			}
		}
	}
	for _, rs := range reads {
		sort.Slice(rs, func(i, j int) bool { return rs[i].t < rs[j].t })
	}
	for i := range ops {
		in := ops[i].Input.(cycleInput)
		if in.write != pendingWrite {
			continue
		}
		f := ops[i].Metadata.(uint64)
		for _, r := range reads[in.key] {
			if r.t > ops[i].Call && r.f > f {
				ops[i].Return = r.t
				break
			}
		}
	}
}

// checkLinearizable runs porcupine over each key's cycles.
func (c *checker) checkLinearizable() {
	byKey := map[string][]porcupine.Operation{}
	for _, op := range cycles(c.in.Workers, math.MaxInt64, !c.in.NoFencing) {
		k := op.Input.(cycleInput).key
		if _, ok := c.in.ModeKeys[k]; ok {
			continue // a register of one writer at a time: checkModes judges those
		}
		byKey[k] = append(byKey[k], op)
	}
	keys := make([]string, 0, len(byKey))
	for k := range byKey {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	model := counterModel.ToModel()
	for _, k := range keys {
		ops := byKey[k]
		c.rep.LinearizableOps += len(ops)
		switch porcupine.CheckOperationsTimeout(model, ops, linearizeTimeout) {
		case porcupine.Ok:
			c.rep.LinearizableKeys++
		case porcupine.Unknown:
			c.inconclusive("porcupine could not decide within %s whether the %d work cycles of %s are linearizable", linearizeTimeout, len(ops), k)
		case porcupine.Illegal:
			c.violate(vNotLinearizable, "%s: no order of its %d work cycles fits what the workers saw", k, len(ops))
		}
	}
}
