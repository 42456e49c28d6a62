package etcdlock

import (
	"context"
	"fmt"
	"math"
	"strconv"

	"github.com/dlock-dev/dlock"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// ErrStaleFence means a fenced transaction presented an older fence than
// the newest its resource has seen: the lock that gave it has passed to
// another holder. Nothing was changed.
// It is dlock.ErrStaleFence.
var ErrStaleFence = dlock.ErrStaleFence

// HeldCmp returns a comparison for the caller's own etcd transaction
// (clientv3.Txn.If) that is true only while the lock of key granted with
// fence is still held: pass a Lock's Key and Fence. A transaction guarded
// by it commits its writes only if the lock was held when etcd applied it,
// whatever the holder's process believes: after a release, an expiry or a
// forced release, it fails (TxnResponse.Succeeded is false) and changes
// nothing. It serves every mode.
//
// HeldCmp reads key's queue once, finds the entry whose create revision is
// fence and checks that it holds the lock, and returns the comparison
// "that entry's create revision is fence". The comparison stays true
// exactly as long as that entry exists: an entry is deleted when its lock
// is released or its lease expires (etcd revokes it), and a key written
// again has a new create revision, so an entry of the same name created
// later never matches. Nor can the entry exist without holding: entries
// join a queue only behind it, and the entries ahead of it only leave, so
// an entry that held the lock when HeldCmp read the queue holds it until
// it is deleted. (For an exclusive lock, it stays the queue's head.)
//
// Run the transaction through the client the Backend uses, or one with the
// same namespace: the comparison names the entry's key as the Backend sees
// it.
//
// The error matches dlock.ErrInvalidKey for an invalid key and
// dlock.ErrInvalidOption for a fence that is 0 or above math.MaxInt64 (no
// revision), before any I/O; dlock.ErrNotHeld when no entry of key holds
// the lock with that fence (it was released, it expired, or the fence is
// a waiting entry's or not key's).
func (b *Backend) HeldCmp(ctx context.Context, key string, fence uint64) (clientv3.Cmp, error) {
	if err := dlock.ValidateKey(key); err != nil {
		return clientv3.Cmp{}, fmt.Errorf("etcdlock: held comparison: %w", err)
	}
	if fence == 0 || fence > math.MaxInt64 {
		return clientv3.Cmp{}, fmt.Errorf("%w: etcdlock: held comparison of %q: fence %d is no revision", dlock.ErrInvalidOption, key, fence)
	}
	// The entries up to fence's are the entry and those ahead of it: all
	// that decide whether it holds.
	var resp *clientv3.GetResponse
	err := b.retry(ctx, func(ctx context.Context) error {
		var err error
		resp, err = b.c.Get(ctx, b.dir(key), clientv3.WithPrefix(), clientv3.WithMaxCreateRev(int64(fence)),
			clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
		return err
	})
	if err != nil {
		return clientv3.Cmp{}, fmt.Errorf("etcdlock: held comparison of %q: %w", key, err)
	}
	q := items(resp.Kvs)
	if n := len(q); n > 0 && q[n-1].kv.CreateRevision == int64(fence) && holders(q)[n-1] {
		return clientv3.Compare(clientv3.CreateRevision(string(q[n-1].kv.Key)), "=", int64(fence)), nil
	}
	return clientv3.Cmp{}, fmt.Errorf("%w: etcdlock: %q is not held with fence %d", dlock.ErrNotHeld, key, fence)
}

// FencePrefix starts the etcd key of every fence record of FencedTxn:
// resource r's record is FencePrefix + r. It lies outside DefaultPrefix,
// so that no record is taken for a lock's entry.
const FencePrefix = "dlock-fence/"

// fenceDigits is the width of a fence in a record: every uint64 in
// decimal, zero-padded so that etcd's byte-wise comparison of values
// orders fences as numbers.
const fenceDigits = 20

// FencedTxn commits ops in one etcd transaction only if fence is at least
// the newest fence presented for resource, and returns the ops' responses
// in order. Use it for data in etcd guarded by a lock of another store (a
// lock of this Backend has HeldCmp, which needs no record). A fence
// equal to the newest is accepted, so one holder writes many times; the
// first fence presented for a resource is always accepted. With no ops,
// FencedTxn only raises the record: a new holder fences out the previous
// one before its first write.
//
// The record (FencePrefix + resource) holds the newest fence, zero-padded
// to 20 digits, without a lease. One transaction compares it and, if it
// is not newer than fence, writes fence to it and applies ops; otherwise
// it changes nothing and FencedTxn returns an error matching
// ErrStaleFence. Every writer of the resource must present fences of one
// lock key, and every write to its data must go through FencedTxn. ops
// must not write the record, and obey etcd's rules for a transaction's
// ops (no key put twice, at most the server's --max-txn-ops, 128 by
// default, counting the record's put).
//
// Before any I/O, the error matches dlock.ErrInvalidKey for a resource
// that is not 1..255 bytes of UTF-8 without NUL, and
// dlock.ErrInvalidOption for a fence of 0.
func FencedTxn(ctx context.Context, kv clientv3.KV, resource string, fence uint64, ops ...clientv3.Op) ([]*pb.ResponseOp, error) {
	if err := dlock.ValidateKey(resource); err != nil {
		return nil, fmt.Errorf("etcdlock: fenced transaction: resource: %w", err)
	}
	if fence == 0 {
		return nil, fmt.Errorf("%w: etcdlock: fenced transaction of %q: fence 0 (fences start at 1)", dlock.ErrInvalidOption, resource)
	}
	rec := FencePrefix + resource
	f := fmt.Sprintf("%0*d", fenceDigits, fence)
	apply := append([]clientv3.Op{clientv3.OpPut(rec, f)}, ops...)
	// A missing record fails every value comparison, so the first fence
	// is accepted by a branch of its own: etcd has no "or".
	resp, err := kv.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(rec), "=", 0)).
		Then(apply...).
		Else(clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.Value(rec), ">", f)},
			[]clientv3.Op{clientv3.OpGet(rec)},
			apply)).
		Commit()
	if err != nil {
		return nil, fmt.Errorf("etcdlock: fenced transaction of %q: %w", resource, err)
	}
	if resp.Succeeded {
		return resp.Responses[1:], nil
	}
	inner := resp.Responses[0].GetResponseTxn()
	if !inner.GetSucceeded() {
		return inner.Responses[1:], nil
	}
	newest := "?"
	if rs := inner.GetResponses(); len(rs) > 0 && len(rs[0].GetResponseRange().GetKvs()) > 0 {
		kvs := rs[0].GetResponseRange().GetKvs()
		if n, err := strconv.ParseUint(string(kvs[0].Value), 10, 64); err == nil {
			newest = strconv.FormatUint(n, 10)
		}
	}
	return nil, fmt.Errorf("%w: %q: fence %d, the newest is %s", ErrStaleFence, resource, fence, newest)
}
