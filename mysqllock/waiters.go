package mysqllock

import (
	"context"
	"encoding/hex"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/dlock-dev/dlock"
)

// A blocking GET_LOCK names its lock in hex in the statement's text (no
// parameters), so that the server's process list shows which lock each
// waiting session waits for: a prepared statement's text shows only "?".

// waitStatement is the statement that waits up to wait for the named lock.
func waitStatement(name string, wait time.Duration) string {
	return fmt.Sprintf("SELECT GET_LOCK(X'%x', %s)", name, strconv.FormatFloat(wait.Seconds(), 'f', -1, 64))
}

// waitersSQL finds the sessions waiting in such a statement.
const waitersSQL = `SELECT ID, USER, HOST, TIME, INFO FROM information_schema.PROCESSLIST
WHERE STATE = 'User lock' AND INFO LIKE 'SELECT GET_LOCK(X''%'`

var waitRE = regexp.MustCompile(`^SELECT GET_LOCK\(X'([0-9a-f]*)', `)

// namedWaiters returns the sessions waiting for the named locks that name
// gives to keys starting with prefix. keys lists such keys, for the names
// that hash a long key; it is called only if a waiter has one.
func namedWaiters(ctx context.Context, db querier, prefix string, name func(key string) string, keys func() ([]string, error)) ([]dlock.WaiterInfo, error) {
	rows, err := db.QueryContext(ctx, waitersSQL)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	type waiting struct {
		name, client string
		secs         int64
	}
	var ws []waiting
	for rows.Next() {
		var (
			id         int64
			user, host string
			secs       int64
			info       string
		)
		if err := rows.Scan(&id, &user, &host, &secs, &info); err != nil {
			return nil, err
		}
		m := waitRE.FindStringSubmatch(info)
		if m == nil {
			continue
		}
		n, err := hex.DecodeString(m[1])
		if err != nil {
			continue
		}
		ws = append(ws, waiting{string(n), fmt.Sprintf("connection %d %s@%s", id, user, host), secs})
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var hashed map[string]string // name → key, of the keys listed
	stem, _ := strings.CutSuffix(name(""), ":")
	now := time.Now()
	var out []dlock.WaiterInfo
	for _, w := range ws {
		key, ok := strings.CutPrefix(w.name, stem+":")
		if !ok || name(key) != w.name {
			if hashed == nil {
				ks, err := keys()
				if err != nil {
					return nil, err
				}
				hashed = make(map[string]string, len(ks))
				for _, k := range ks {
					hashed[name(k)] = k
				}
			}
			if key, ok = hashed[w.name]; !ok {
				continue
			}
		}
		if strings.HasPrefix(key, prefix) {
			out = append(out, dlock.WaiterInfo{Key: key, Client: w.client, Since: now.Add(-time.Duration(w.secs) * time.Second)})
		}
	}
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Key != out[j].Key {
			return out[i].Key < out[j].Key
		}
		return out[i].Since.Before(out[j].Since)
	})
	return out, nil
}

// keysIn returns the keys starting with prefix that have a row in table.
func keysIn(ctx context.Context, db querier, table, prefix string) ([]string, error) {
	rows, err := db.QueryContext(ctx, `SELECT name FROM `+table+` WHERE LEFT(name, ?) = ?`, len(prefix), []byte(prefix))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var n []byte
		if err := rows.Scan(&n); err != nil {
			return nil, err
		}
		out = append(out, string(n))
	}
	return out, rows.Err()
}

var (
	_ dlock.WaiterLister = (*Backend)(nil)
	_ dlock.WaiterLister = (*GetLock)(nil)
)

// ListWaiters implements dlock.WaiterLister for the lease strategy with
// doorbells: the sessions waiting on a key's doorbell, read from the
// server's process list (information_schema.PROCESSLIST), which names no
// owner: Client is the waiting connection (its id, user and host) and Since
// the start of its current wait, to the second. A waiter looks at the lease
// again every quarter of its TTL, and is not listed for that moment; the
// first in line, which holds the doorbell while the holder's lease runs
// out, is not listed either. Mode is not known (Exclusive). The process
// list shows other users' sessions only to a user with the PROCESS
// privilege. Without doorbells (Options.NoDoorbell) waiters poll and
// nothing records them: ListWaiters returns dlock.ErrUnsupported.
func (b *Backend) ListWaiters(ctx context.Context, prefix string) ([]dlock.WaiterInfo, error) {
	if !b.bells() {
		return nil, fmt.Errorf("mysqllock: list waiters: waiters poll without doorbells: %w", dlock.ErrUnsupported)
	}
	ws, err := namedWaiters(ctx, b.db, prefix, b.bell.name, func() ([]string, error) { return keysIn(ctx, b.db, b.table, prefix) })
	if err != nil {
		return nil, b.wrap("list waiters", err)
	}
	return ws, nil
}

// ListWaiters implements dlock.WaiterLister: the sessions waiting in
// GET_LOCK for a key, read from the server's process list
// (information_schema.PROCESSLIST), which names no owner: Client is the
// waiting connection (its id, user and host) and Since the start of its
// wait, to the second. Named locks are server-wide, so waiters for the key
// through another table of the server are listed too. The process list
// shows other users' sessions only to a user with the PROCESS privilege.
func (g *GetLock) ListWaiters(ctx context.Context, prefix string) ([]dlock.WaiterInfo, error) {
	ws, err := namedWaiters(ctx, g.s.db, prefix, g.name, func() ([]string, error) { return keysIn(ctx, g.s.db, g.s.table, prefix) })
	if err != nil {
		return nil, wrapErr(g.s.table, "getlock list waiters", err)
	}
	return ws, nil
}
