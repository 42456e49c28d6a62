package torture

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dlock-dev/dlock/internal/testproc"
	"github.com/go-zookeeper/zk"
)

// TestZKLogRealServer writes known transactions to a real ZooKeeper (started here) and reads
// them back from its transaction log: every type zklock's history depends on, failed requests,
// and closeSession's list of the session's ephemeral nodes.
func TestZKLogRealServer(t *testing.T) {
	addr, dataDir := testproc.StartZooKeeper(t)
	before := time.Now().UnixMilli()
	c, _, err := zk.Connect([]string{addr}, 4*time.Second, zk.WithLogger(zkQuiet{}))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	acl := zk.WorldACL(zk.PermAll)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	_, err = c.Create("/t", []byte("root"), zk.FlagPersistent, acl)
	must(err)
	session := c.SessionID()
	_, err = c.CreateContainer("/t/kq", nil, zk.FlagContainer, acl)
	must(err)
	// zklock's enqueue: an ephemeral sequential node and a touch of the directory.
	res, err := c.Multi(
		&zk.CreateRequest{Path: "/t/kq/n-", Data: []byte(`{"token":"ab"}`), Acl: acl, Flags: zk.FlagEphemeralSequential},
		&zk.SetDataRequest{Path: "/t/kq", Data: nil, Version: -1},
	)
	must(err)
	node := res[0].String
	st, err := c.Set(node, []byte("renewed"), 0)
	must(err)
	if err := c.Delete("/t/missing", -1); err == nil {
		t.Fatal("deleted a missing node")
	}
	if _, err := c.Multi(&zk.SetDataRequest{Path: node, Data: []byte("x"), Version: 7}, &zk.DeleteRequest{Path: node, Version: -1}); err == nil {
		t.Fatal("a multi with a bad version succeeded")
	}
	_, err = c.Create("/t/e", []byte{}, zk.FlagEphemeral, acl)
	must(err)
	_, err = c.Create("/t/p", nil, zk.FlagPersistent, acl)
	must(err)
	c.Close() // closeSession: deletes the session's ephemeral nodes
	c2, _, err := zk.Connect([]string{addr}, 4*time.Second, zk.WithLogger(zkQuiet{}))
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	must(c2.Delete("/t/p", -1))
	endSt, err := c2.Set("/t", nil, -1)
	must(err)
	after := time.Now().UnixMilli()

	log, err := readZKLog(dataDir, 0)
	must(err)
	if log.Tail != "" || log.Last < endSt.Mzxid {
		t.Fatalf("log ends at %#x (tail %q), want %#x", log.Last, log.Tail, endSt.Mzxid)
	}
	type want struct {
		typ  int32
		ops  []zkOp
		mine bool // sent by the first session
	}
	wants := []want{
		{zkOpCreateSession, []zkOp{{Type: zkOpCreateSession, Timeout: 4000}}, true},
		{zkOpCreate, []zkOp{{Type: zkOpCreate, Path: "/t", Data: []byte("root")}}, true},
		{zkOpCreateContainer, []zkOp{{Type: zkOpCreateContainer, Path: "/t/kq"}}, true},
		{zkOpMulti, []zkOp{
			{Type: zkOpCreate, Path: node, Data: []byte(`{"token":"ab"}`), Ephemeral: true},
			{Type: zkOpSetData, Path: "/t/kq", Version: 1},
		}, true},
		{zkOpSetData, []zkOp{{Type: zkOpSetData, Path: node, Data: []byte("renewed"), Version: 1}}, true},
		{zkOpError, []zkOp{{Type: zkOpError, Err: -101}}, true},
		{zkOpMulti, []zkOp{{Type: zkOpError, Err: -103}, {Type: zkOpError, Err: -2}}, true},
		{zkOpCreate, []zkOp{{Type: zkOpCreate, Path: "/t/e", Data: []byte{}, Ephemeral: true}}, true},
		{zkOpCreate, []zkOp{{Type: zkOpCreate, Path: "/t/p"}}, true},
		{zkOpCloseSession, []zkOp{{Type: zkOpCloseSession, HasPaths: true, Paths2Delete: []string{"/t/e", node}}}, true},
		{zkOpCreateSession, []zkOp{{Type: zkOpCreateSession, Timeout: 4000}}, false},
		{zkOpDelete, []zkOp{{Type: zkOpDelete, Path: "/t/p"}}, false},
		{zkOpSetData, []zkOp{{Type: zkOpSetData, Path: "/t", Version: 1}}, false},
	}
	if len(log.Txns) != len(wants) {
		for _, x := range log.Txns {
			t.Logf("%+v", x)
		}
		t.Fatalf("%d transactions, want %d", len(log.Txns), len(wants))
	}
	for i, w := range wants {
		x := log.Txns[i]
		if x.Zxid != int64(i+1) || x.Type != w.typ || (x.Session == session) != w.mine || x.TimeMs < before || x.TimeMs > after {
			t.Errorf("txn %d: %+v, want type %d, zxid %d, session %#x: %v, time in [%d, %d]", i, x, w.typ, i+1, session, w.mine, before, after)
		}
		if len(x.Ops) != len(w.ops) {
			t.Errorf("txn %d: ops %+v, want %+v", i, x.Ops, w.ops)
			continue
		}
		for j, o := range x.Ops {
			wo := w.ops[j]
			if o.Type != wo.Type || o.Path != wo.Path || !bytes.Equal(o.Data, wo.Data) || (o.Data == nil) != (wo.Data == nil) ||
				o.Ephemeral != wo.Ephemeral || o.Version != wo.Version || o.Err != wo.Err || o.Timeout != wo.Timeout ||
				o.HasPaths != wo.HasPaths || strings.Join(slices.Sorted(slices.Values(o.Paths2Delete)), ",") != strings.Join(wo.Paths2Delete, ",") {
				t.Errorf("txn %d op %d: %+v, want %+v", i, j, o, wo)
			}
		}
	}
	if x := log.Txns[4]; x.TimeMs != st.Mtime {
		t.Errorf("setData logged at %d ms, its mtime is %d", x.TimeMs, st.Mtime)
	}
	if !log.Txns[3].Applied() || log.Txns[5].Applied() || log.Txns[6].Applied() {
		t.Errorf("Applied: enqueue %v, failed delete %v, failed multi %v", log.Txns[3].Applied(), log.Txns[5].Applied(), log.Txns[6].Applied())
	}
	// from skips what precedes it.
	if l2, err := readZKLog(dataDir, 5); err != nil || len(l2.Txns) != len(wants)-5 || l2.Txns[0].Zxid != 6 {
		t.Errorf("readZKLog from 5: %v, %v", l2, err)
	}

	t.Run("files", func(t *testing.T) { testZKLogFiles(t, dataDir, len(wants)) })
}

// testZKLogFiles copies the real log, damages its last record, splits it in two files: a torn
// last record ends the log (it may be being written), the same in an earlier file is an error,
// and a gap between files is an error.
func testZKLogFiles(t *testing.T, dataDir string, n int) {
	files, err := zkLogFiles(dataDir)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(files[len(files)-1].Path)
	if err != nil {
		t.Fatal(err)
	}
	// The offsets of the records, and the end of the valid ones.
	var offs []int
	off := 16
	for {
		size := int(binary.BigEndian.Uint32(raw[off+8:]))
		if size == 0 {
			break
		}
		offs = append(offs, off)
		off += 12 + size + 1
	}
	if len(offs) < n {
		t.Fatalf("%d records, want at least %d", len(offs), n)
	}
	valid := raw[:off+64] // and some of the zeros
	lastOff := offs[len(offs)-1]
	for _, tc := range []struct {
		name, tail string
		damage     func(b []byte) []byte
	}{
		{"intact", "", func(b []byte) []byte { return b }},
		{"cut in the body", "cut off", func(b []byte) []byte { return b[:lastOff+20] }},
		{"cut in the length", "cut off after 10 bytes", func(b []byte) []byte { return b[:lastOff+10] }},
		{"zeros in the body", "checksum mismatch", func(b []byte) []byte { clear(b[lastOff+30 : off-1]); return b }},
		{"no end mark", "end mark", func(b []byte) []byte { b[off-1] = 0; return b }},
		{"flipped bit", "checksum mismatch", func(b []byte) []byte { b[lastOff+40] ^= 4; return b }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			first := filepath.Base(files[len(files)-1].Path)
			if err := os.WriteFile(filepath.Join(dir, first), tc.damage(bytes.Clone(valid)), 0o644); err != nil {
				t.Fatal(err)
			}
			log, err := readZKLog(dir, 0)
			if err != nil {
				t.Fatal(err)
			}
			wantN := len(offs)
			if tc.tail != "" {
				wantN--
			}
			if !strings.Contains(log.Tail, tc.tail) || (tc.tail == "") != (log.Tail == "") || len(log.Txns) != wantN {
				t.Errorf("tail %q, %d txns; want %q, %d", log.Tail, len(log.Txns), tc.tail, wantN)
			}
			if tc.tail == "" {
				return
			}
			// A later file: the damage is in the middle of the log.
			later := log.Last + 1
			if err := os.WriteFile(filepath.Join(dir, "log."+strconv.FormatInt(later, 16)), valid[:16], 0o644); err != nil {
				t.Fatal(err)
			}
			if _, err := readZKLog(dir, 0); err == nil || !strings.Contains(err.Error(), "later log file") {
				t.Errorf("damage before a later file: %v", err)
			}
		})
	}
	// The same records split in two files, as the server rolls its log: the same transactions,
	// and a from beyond the first file skips it.
	dir := t.TempDir()
	k := len(offs) / 2
	second := append(bytes.Clone(valid[:16]), valid[offs[k]:]...)
	firstZxid := int64(binary.BigEndian.Uint64(valid[offs[0]+12+12:]))
	splitZxid := firstZxid + int64(k)
	for name, b := range map[string][]byte{
		"log." + strconv.FormatInt(firstZxid, 16): valid[:offs[k]],
		"log." + strconv.FormatInt(splitZxid, 16): second,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	whole, err := readZKLog(filepath.Dir(files[0].Path), 0)
	if err != nil {
		t.Fatal(err)
	}
	split, err := readZKLog(dir, 0)
	if err != nil || len(split.Txns) != len(offs) || split.Last != whole.Txns[len(offs)-1].Zxid {
		t.Fatalf("split log: %v, %d txns, last %#x", err, len(split.Txns), split.Last)
	}
	for i := range split.Txns {
		if split.Txns[i].Zxid != whole.Txns[i].Zxid || split.Txns[i].TimeMs != whole.Txns[i].TimeMs {
			t.Errorf("split log, txn %d: %+v, want %+v", i, split.Txns[i], whole.Txns[i])
		}
	}
	if l, err := readZKLog(dir, splitZxid); err != nil || len(l.Txns) != len(offs)-k-1 || l.Txns[0].Zxid != splitZxid+1 {
		t.Errorf("split log from %#x: %v, %v", splitZxid, l, err)
	}
	// The first file gone (purged).
	purged := t.TempDir()
	if err := os.WriteFile(filepath.Join(purged, "log."+strconv.FormatInt(splitZxid, 16)), second, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readZKLog(purged, splitZxid-2); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("a log without its first file: %v", err)
	}
	// A gap between the files.
	if err := os.Remove(filepath.Join(dir, "log."+strconv.FormatInt(splitZxid, 16))); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "log."+strconv.FormatInt(splitZxid+1, 16)), append(bytes.Clone(valid[:16]), valid[offs[k+1]:]...), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readZKLog(dir, 0); err == nil || !strings.Contains(err.Error(), "gap") {
		t.Errorf("a missing transaction: %v", err)
	}

	// Not a log.
	dir = t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "log.1"), []byte("ZKSN\x00\x00\x00\x02"+strings.Repeat("\x00", 8)), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readZKLog(dir, 0); err == nil || !strings.Contains(err.Error(), "not a ZooKeeper transaction log") {
		t.Errorf("a snapshot's header: %v", err)
	}
}
