package torture

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/adler32"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// A reader of ZooKeeper's transaction log (the files <dataDir>/version-2/log.<hex zxid>), as
// written by ZooKeeper 3.5–3.9 (checked against 3.8.0, the version the tests run). The format is
// Jute's binary archive, big-endian: a file header {int magic "ZKLG", int version 2, long dbid},
// then records {long checksum, int length, length bytes, byte 'B'}. The checksum is the Adler-32
// of the length bytes, which hold a TxnHeader {long clientId, int cxid, long zxid, long time,
// int type}, the transaction's body by type, and since 3.6 (when zookeeper.digest.enabled, the
// default) a TxnDigest {int version, long treeDigest}. The server preallocates the file with
// zeros, so a zero length ends the valid log. Failed requests are logged too, as type error (-1)
// with an ErrorTxn {int err}, and a failed multi as a multi whose every part is an error.

// ZooKeeper's transaction types (org.apache.zookeeper.ZooDefs.OpCode).
const (
	zkOpError           = -1
	zkOpCreate          = 1
	zkOpDelete          = 2
	zkOpSetData         = 5
	zkOpSetACL          = 7
	zkOpCheck           = 13
	zkOpMulti           = 14
	zkOpCreate2         = 15
	zkOpReconfig        = 16
	zkOpCreateContainer = 19
	zkOpDeleteContainer = 20
	zkOpCreateTTL       = 21
	zkOpCreateSession   = -10
	zkOpCloseSession    = -11
)

const (
	zkLogMagic   = 0x5a4b4c47 // "ZKLG"
	zkLogVersion = 2
	zkDigestLen  = 12      // TxnDigest: int version, long treeDigest
	zkMaxRecord  = 1 << 26 // larger than any record the server accepts (jute.maxbuffer is 1 MiB)
)

// zkTxn is one transaction of the log.
type zkTxn struct {
	Session int64 // TxnHeader.clientId: the session that sent the request (or that expired)
	Cxid    int32
	Zxid    int64
	TimeMs  int64 // the leader's wall clock when it prepared the transaction, in ms since the epoch
	Type    int32
	// Ops are the transaction's changes in the order the server applies them: one for a plain
	// transaction, the parts of a multi. A failed request is one op of type error; a failed
	// multi has only error parts (nothing of it was applied).
	Ops []zkOp
}

// zkOp is one change (or a multi's part).
type zkOp struct {
	Type      int32
	Path      string
	Data      []byte // create*, setData (nil: null)
	Ephemeral bool   // create, create2
	Version   int32  // setData: the node's new version; check: the expected version
	// Paths2Delete: closeSession's list of the session's ephemeral nodes (ZooKeeper ≥ 3.6 with
	// zookeeper.closeSessionTxn.enabled, the default); nil when the log has none.
	Paths2Delete []string
	HasPaths     bool  // the closeSession carried a CloseSessionTxn body (possibly empty)
	Err          int32 // error: the KeeperException code
	Timeout      int32 // createSession: the negotiated session timeout, ms
}

// Applied reports whether the transaction changed anything (a failed request or multi did not).
func (t *zkTxn) Applied() bool {
	for _, o := range t.Ops {
		if o.Type == zkOpError {
			return false
		}
	}
	return true
}

// zkLogFile is a log file and the first zxid it holds (its name).
type zkLogFile struct {
	Path  string
	First int64
}

// zkLogFiles lists the log files in dir in zxid order. dir is the server's dataDir (or
// dataLogDir), which holds version-2/, or version-2 itself.
func zkLogFiles(dir string) ([]zkLogFile, error) {
	if fi, err := os.Stat(filepath.Join(dir, "version-2")); err == nil && fi.IsDir() {
		dir = filepath.Join(dir, "version-2")
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []zkLogFile
	for _, e := range ents {
		hex, ok := strings.CutPrefix(e.Name(), "log.")
		if !ok || e.IsDir() {
			continue
		}
		z, err := strconv.ParseUint(hex, 16, 64)
		if err != nil {
			continue
		}
		out = append(out, zkLogFile{Path: filepath.Join(dir, e.Name()), First: int64(z)})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no transaction log (log.*) in %s", dir)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].First < out[j].First })
	return out, nil
}

// zkLog is what readZKLog read.
type zkLog struct {
	Txns []zkTxn // zxid > the from argument, in zxid order
	Last int64   // the last zxid read (whatever its value relative to from); 0 if none
	// Tail says why the last file's reading stopped: "" at the preallocated zeros or the end of
	// the file, otherwise the torn or corrupt record found there (a record being written when the
	// file was read, or damage).
	Tail string
}

// readZKLog reads the transactions with zxid > from from the log files in dir (see zkLogFiles).
// A file ends at its preallocated zeros; a record that is cut off, lacks its end mark or fails
// its checksum ends the log when it is in the last file (it may be being written), and is an
// error in an earlier one. Zxids must follow each other without gaps within an epoch, from
// from+1 on.
func readZKLog(dir string, from int64) (*zkLog, error) {
	files, err := zkLogFiles(dir)
	if err != nil {
		return nil, err
	}
	out := &zkLog{}
	for i, f := range files {
		if i+1 < len(files) && files[i+1].First <= from+1 {
			continue // holds nothing after from
		}
		last := i+1 == len(files)
		tail, err := readZKLogFile(f.Path, func(t zkTxn) error {
			if out.Last != 0 && t.Zxid != out.Last+1 && (t.Zxid>>32 <= out.Last>>32 || t.Zxid <= out.Last) {
				return fmt.Errorf("zxid %#x follows %#x: the log has a gap or goes back", t.Zxid, out.Last)
			}
			out.Last = t.Zxid
			if t.Zxid > from {
				out.Txns = append(out.Txns, t)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.Path, err)
		}
		if tail != "" && !last {
			return nil, fmt.Errorf("%s: %s, and a later log file exists", f.Path, tail)
		}
		out.Tail = tail
	}
	if t := out.Txns; from > 0 && len(t) > 0 && t[0].Zxid != from+1 && t[0].Zxid>>32 == from>>32 {
		return nil, fmt.Errorf("the log in %s resumes at zxid %#x, after %#x: files are missing (purged?)", dir, t[0].Zxid, from)
	}
	return out, nil
}

// readZKLogFile calls fn for each valid record of one log file. It returns a non-empty tail when
// the file ends in a torn or corrupt record, and an error for a bad header, an unparsable record
// (one whose checksum matched) or fn's error.
func readZKLogFile(path string, fn func(zkTxn) error) (tail string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	r := bufio.NewReaderSize(f, 1<<16)
	var hdr [16]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return "", fmt.Errorf("file header: %w", err)
	}
	if m, v := binary.BigEndian.Uint32(hdr[0:]), binary.BigEndian.Uint32(hdr[4:]); m != zkLogMagic || v != zkLogVersion {
		return "", fmt.Errorf("not a ZooKeeper transaction log (magic %#x, version %d)", m, v)
	}
	off := int64(len(hdr))
	var head [12]byte
	for {
		n, err := io.ReadFull(r, head[:])
		if err == io.EOF {
			return "", nil
		}
		if err != nil {
			return fmt.Sprintf("record at offset %d cut off after %d bytes", off, n), nil
		}
		sum, size := binary.BigEndian.Uint64(head[0:]), int32(binary.BigEndian.Uint32(head[8:]))
		if size == 0 {
			if sum != 0 {
				return fmt.Sprintf("record at offset %d: zero length with checksum %#x", off, sum), nil
			}
			return "", nil // the preallocated zeros
		}
		if size < 0 || size > zkMaxRecord {
			return fmt.Sprintf("record at offset %d: length %d", off, size), nil
		}
		body := make([]byte, int(size)+1)
		if _, err := io.ReadFull(r, body); err != nil {
			return fmt.Sprintf("record at offset %d (%d bytes) cut off", off, size), nil
		}
		if body[size] != 'B' {
			return fmt.Sprintf("record at offset %d: end mark %#x, not 'B'", off, body[size]), nil
		}
		body = body[:size]
		if uint64(adler32.Checksum(body)) != sum {
			return fmt.Sprintf("record at offset %d: checksum mismatch", off), nil
		}
		t, err := parseZKTxn(body)
		if err != nil {
			return "", fmt.Errorf("record at offset %d: %w", off, err)
		}
		if err := fn(t); err != nil {
			return "", err
		}
		off += int64(len(head)) + int64(size) + 1
	}
}

// parseZKTxn decodes one record: the header, then the body by type. What follows the body must be
// nothing or a TxnDigest.
func parseZKTxn(b []byte) (zkTxn, error) {
	d := &jute{b: b}
	t := zkTxn{Session: d.long(), Cxid: d.int(), Zxid: d.long(), TimeMs: d.long(), Type: d.int()}
	if d.err != nil {
		return t, fmt.Errorf("txn header: %w", d.err)
	}
	if t.Type == zkOpMulti {
		n := d.int()
		if d.err == nil && (n < 0 || int(n) > len(b)) {
			return t, fmt.Errorf("zxid %#x: multi of %d parts", t.Zxid, n)
		}
		for range n {
			typ := d.int()
			part := d.buffer()
			if d.err != nil {
				break
			}
			pd := &jute{b: part}
			op := parseZKOp(pd, typ)
			if pd.err == nil && pd.rest() != 0 {
				pd.err = fmt.Errorf("%d bytes after the body", pd.rest())
			}
			if pd.err != nil {
				return t, fmt.Errorf("zxid %#x: multi part of type %d: %w", t.Zxid, typ, pd.err)
			}
			t.Ops = append(t.Ops, op)
		}
	} else {
		t.Ops = []zkOp{parseZKOp(d, t.Type)}
	}
	if d.err == nil && d.rest() != 0 && d.rest() != zkDigestLen {
		d.err = fmt.Errorf("%d bytes after the body (a digest has %d)", d.rest(), zkDigestLen)
	}
	if d.err != nil {
		return t, fmt.Errorf("zxid %#x type %d: %w", t.Zxid, t.Type, d.err)
	}
	return t, nil
}

// parseZKOp decodes the body of a transaction of type typ.
func parseZKOp(d *jute, typ int32) zkOp {
	op := zkOp{Type: typ}
	switch typ {
	case zkOpCreate, zkOpCreate2: // CreateTxn
		op.Path, op.Data = d.ustring(), d.buffer()
		d.acls()
		op.Ephemeral = d.boolean()
		d.int() // parentCVersion
	case zkOpCreateContainer: // CreateContainerTxn
		op.Path, op.Data = d.ustring(), d.buffer()
		d.acls()
		d.int()
	case zkOpCreateTTL: // CreateTTLTxn
		op.Path, op.Data = d.ustring(), d.buffer()
		d.acls()
		d.int()
		d.long() // ttl
	case zkOpDelete, zkOpDeleteContainer: // DeleteTxn
		op.Path = d.ustring()
	case zkOpSetData: // SetDataTxn
		op.Path, op.Data, op.Version = d.ustring(), d.buffer(), d.int()
	case zkOpSetACL: // SetACLTxn
		op.Path = d.ustring()
		d.acls()
		op.Version = d.int()
	case zkOpCheck: // CheckVersionTxn
		op.Path, op.Version = d.ustring(), d.int()
	case zkOpError: // ErrorTxn
		op.Err = d.int()
	case zkOpCreateSession: // CreateSessionTxn
		op.Timeout = d.int()
	case zkOpCloseSession:
		// A CloseSessionTxn {vector<ustring> paths2Delete} since 3.6 (unless disabled), nothing
		// before; then perhaps a digest. Twelve bytes are a digest unless they read as a list of
		// one 4-byte path.
		if r := d.rest(); r != 0 && (r != zkDigestLen || looksLikePaths(d.b[d.off:])) {
			op.Paths2Delete, op.HasPaths = d.ustrings(), true
		}
	case zkOpReconfig: // SetDataTxn of the config node
		op.Path, op.Data, op.Version = d.ustring(), d.buffer(), d.int()
	default:
		if d.err == nil {
			d.err = fmt.Errorf("unknown transaction type %d", typ)
		}
	}
	return op
}

// looksLikePaths reports whether 12 bytes (a closeSession's remainder) are a CloseSessionTxn
// rather than a TxnDigest: a count of 1 and one 4-byte absolute path.
func looksLikePaths(b []byte) bool {
	return len(b) == 12 && binary.BigEndian.Uint32(b) == 1 && binary.BigEndian.Uint32(b[4:]) == 4 && b[8] == '/'
}

// jute decodes Jute's binary archive; the first error sticks.
type jute struct {
	b   []byte
	off int
	err error
}

func (d *jute) rest() int { return len(d.b) - d.off }

func (d *jute) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || n > d.rest() {
		d.err = fmt.Errorf("%d bytes at offset %d, %d left: %w", n, d.off, d.rest(), errJuteShort)
		return nil
	}
	p := d.b[d.off : d.off+n]
	d.off += n
	return p
}

var errJuteShort = errors.New("record too short")

func (d *jute) int() int32 {
	if p := d.take(4); p != nil {
		return int32(binary.BigEndian.Uint32(p))
	}
	return 0
}

func (d *jute) long() int64 {
	if p := d.take(8); p != nil {
		return int64(binary.BigEndian.Uint64(p))
	}
	return 0
}

func (d *jute) boolean() bool {
	p := d.take(1)
	return p != nil && p[0] != 0
}

// buffer reads an int length and that many bytes; -1 is null (nil).
func (d *jute) buffer() []byte {
	n := d.int()
	if d.err != nil || n == -1 {
		return nil
	}
	p := d.take(int(n))
	if p == nil {
		return nil
	}
	return append([]byte{}, p...)
}

// ustring reads a UTF-8 string (length -1: null, read as "").
func (d *jute) ustring() string {
	n := d.int()
	if d.err != nil || n == -1 {
		return ""
	}
	return string(d.take(int(n)))
}

// ustrings reads a vector<ustring> (-1: null, read as empty).
func (d *jute) ustrings() []string {
	n := d.int()
	if d.err == nil && (n < -1 || int(n) > d.rest()) {
		d.err = fmt.Errorf("string vector of %d", n)
	}
	out := []string{}
	for range max(n, 0) {
		out = append(out, d.ustring())
	}
	return out
}

// acls reads a vector<ACL> (each {int perms, Id {ustring scheme, ustring id}}) and drops it.
func (d *jute) acls() {
	n := d.int()
	if d.err == nil && (n < -1 || int(n) > d.rest()) {
		d.err = fmt.Errorf("ACL vector of %d", n)
	}
	for range max(n, 0) {
		d.int()
		d.ustring()
		d.ustring()
	}
}
