// Package release prepares this repository's modules for a release and
// shows them to the go command as a release would.
//
// The repository holds several modules (the core, one per backend, the
// CLI). Each go.mod requires its siblings at the release version and has no
// replace directive, so that `go get` and `go install pkg@version` work
// once the tags exist; go.work joins the modules for development, with a
// replace for each sibling at that version so that the workspace builds
// before the tags are published. [SetVersion] writes those requirements
// (scripts/release.sh calls it through cmd/dlock-release), and [Publish]
// writes the modules of a working tree into a GOPROXY=file:// directory,
// as the go command would download them once tagged.
package release

import (
	"archive/zip"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
	modzip "golang.org/x/mod/zip"
)

// Path is the module path of the repository's root module; every other
// module's path is Path + "/" + its directory.
const Path = "github.com/dlock-dev/dlock"

// Published lists the directories (slash-separated, relative to the
// repository root) of the modules that users install, each after the
// modules it requires. scripts/release.sh tags each of them.
var Published = []string{".", "dlockotel", "etcdlock", "mysqllock", "pglock", "redislock", "sqlitelock", "zklock", "cmd/dlock"}

// Development lists the modules that are built only inside the repository
// (benchmarks, the fault harness, this package). Their requirements are set
// like the others' but they are not tagged.
var Development = []string{"bench", "internal/release", "torture"}

// ErrVersion reports a version that is not a canonical semantic version
// such as v0.1.0.
var ErrVersion = errors.New("release: the version must look like v1.2.3")

// ModulePath returns the module path of the module in directory dir
// (relative to the repository root).
func ModulePath(dir string) string {
	if dir == "." || dir == "" {
		return Path
	}
	return Path + "/" + dir
}

func isSibling(p string) bool { return p == Path || strings.HasPrefix(p, Path+"/") }

func checkVersion(version string) error {
	if !semver.IsValid(version) || semver.Canonical(version) != version || semver.Build(version) != "" {
		return fmt.Errorf("%w: %q", ErrVersion, version)
	}
	return nil
}

// ReleaseGoMod returns the go.mod data with every requirement on a module
// of this repository set to version and every replace directive of such a
// module dropped.
func ReleaseGoMod(data []byte, version string) ([]byte, error) {
	if err := checkVersion(version); err != nil {
		return nil, err
	}
	f, err := modfile.Parse("go.mod", data, nil)
	if err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	for _, r := range f.Require {
		if isSibling(r.Mod.Path) && r.Mod.Version != version {
			if err := f.AddRequire(r.Mod.Path, version); err != nil {
				return nil, fmt.Errorf("release: %w", err)
			}
		}
	}
	for _, r := range slices.Clone(f.Replace) {
		if isSibling(r.Old.Path) {
			if err := f.DropReplace(r.Old.Path, r.Old.Version); err != nil {
				return nil, fmt.Errorf("release: %w", err)
			}
		}
	}
	f.Cleanup()
	return modfile.Format(f.Syntax), nil
}

// ReleaseGoWork returns the go.work data with one replace directive per
// published library module at version (pointing at its directory), so that
// the workspace resolves the siblings' requirements before the tags exist;
// replaces of those modules at other versions are dropped.
func ReleaseGoWork(data []byte, version string) ([]byte, error) {
	if err := checkVersion(version); err != nil {
		return nil, err
	}
	f, err := modfile.ParseWork("go.work", data, nil)
	if err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	for _, r := range slices.Clone(f.Replace) {
		if isSibling(r.Old.Path) {
			if err := f.DropReplace(r.Old.Path, r.Old.Version); err != nil {
				return nil, fmt.Errorf("release: %w", err)
			}
		}
	}
	for _, dir := range Published {
		if dir == "cmd/dlock" { // a command: nothing requires it
			continue
		}
		if err := f.AddReplace(ModulePath(dir), version, "./"+strings.TrimPrefix(dir, "."), ""); err != nil {
			return nil, fmt.Errorf("release: %w", err)
		}
	}
	f.Cleanup()
	return modfile.Format(f.Syntax), nil
}

// SetVersion rewrites, in the working tree at root, the go.mod of every
// published and development module with [ReleaseGoMod] and go.work with
// [ReleaseGoWork].
func SetVersion(root, version string) error {
	for _, dir := range slices.Concat(Published, Development) {
		if err := rewrite(filepath.Join(root, filepath.FromSlash(dir), "go.mod"), version, ReleaseGoMod); err != nil {
			return err
		}
	}
	return rewrite(filepath.Join(root, "go.work"), version, ReleaseGoWork)
}

func rewrite(name, version string, edit func([]byte, string) ([]byte, error)) error {
	data, err := os.ReadFile(name)
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	out, err := edit(data, version)
	if err != nil {
		return fmt.Errorf("release: %s: %w", name, err)
	}
	if bytes.Equal(out, data) {
		return nil
	}
	if err := os.WriteFile(name, out, 0o644); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	return nil
}

// RequiredVersion returns the version at which the published modules of
// the tree at root require their siblings, and an error when they disagree
// or still carry a replace directive for a sibling.
func RequiredVersion(root string) (string, error) {
	version := ""
	for _, dir := range Published {
		name := filepath.Join(root, filepath.FromSlash(dir), "go.mod")
		data, err := os.ReadFile(name)
		if err != nil {
			return "", fmt.Errorf("release: %w", err)
		}
		f, err := modfile.Parse(name, data, nil)
		if err != nil {
			return "", fmt.Errorf("release: %w", err)
		}
		for _, r := range f.Replace {
			if isSibling(r.Old.Path) {
				return "", fmt.Errorf("release: %s replaces %s: a module users install cannot", name, r.Old.Path)
			}
		}
		for _, r := range f.Require {
			if !isSibling(r.Mod.Path) {
				continue
			}
			if version == "" {
				version = r.Mod.Version
			} else if r.Mod.Version != version {
				return "", fmt.Errorf("release: %s requires %s@%s, another module requires %s", name, r.Mod.Path, r.Mod.Version, version)
			}
		}
	}
	if version == "" {
		return "", errors.New("release: no module requires a sibling")
	}
	return version, checkVersion(version)
}

// Publish writes every published module of the working tree at root, at
// version, into dir in the layout a GOPROXY=file:// URL serves: for each
// module, @v/list, @v/VERSION.info, .mod (the go.mod as [ReleaseGoMod]
// leaves it) and .zip. The zip holds what the version would hold if the
// tree were committed and tagged: the files git tracks or would track
// (ignored files are left out), without nested modules, and the root's
// LICENSE in a module of a subdirectory that has none, as the go command
// adds it.
func Publish(root, dir, version string) error {
	if err := checkVersion(version); err != nil {
		return err
	}
	for _, mdir := range Published {
		if err := publishModule(root, dir, mdir, version); err != nil {
			return err
		}
	}
	return nil
}

func publishModule(root, dir, mdir, version string) error {
	m := module.Version{Path: ModulePath(mdir), Version: version}
	srcDir := filepath.Join(root, filepath.FromSlash(mdir))
	gomod, err := os.ReadFile(filepath.Join(srcDir, "go.mod"))
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	if gomod, err = ReleaseGoMod(gomod, version); err != nil {
		return err
	}
	names, err := trackedFiles(root, mdir)
	if err != nil {
		return err
	}
	var files []modzip.File
	haveLicense := false
	for _, name := range names {
		switch name {
		case "go.mod":
			files = append(files, dataFile{name: name, data: gomod})
			continue
		case "LICENSE":
			haveLicense = true
		}
		full := filepath.Join(srcDir, filepath.FromSlash(name))
		info, err := os.Lstat(full)
		if errors.Is(err, fs.ErrNotExist) { // deleted in the working tree
			continue
		}
		if err != nil {
			return fmt.Errorf("release: %w", err)
		}
		if info.IsDir() {
			continue
		}
		files = append(files, diskFile{name: name, full: full, info: info})
	}
	if !haveLicense && mdir != "." {
		if data, err := os.ReadFile(filepath.Join(root, "LICENSE")); err == nil {
			files = append(files, dataFile{name: "LICENSE", data: data})
		}
	}

	escaped, err := module.EscapePath(m.Path)
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	vdir := filepath.Join(dir, filepath.FromSlash(escaped), "@v")
	if err := os.MkdirAll(vdir, 0o755); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	var zbuf bytes.Buffer
	if err := modzip.Create(&zbuf, m, files); err != nil {
		return fmt.Errorf("release: %s: %w", m.Path, err)
	}
	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, time.Now().UTC().Truncate(time.Second)})
	if err != nil {
		return fmt.Errorf("release: %w", err)
	}
	for name, data := range map[string][]byte{
		version + ".zip":  zbuf.Bytes(),
		version + ".mod":  gomod,
		version + ".info": info,
		"list":            []byte(version + "\n"),
	} {
		if err := os.WriteFile(filepath.Join(vdir, name), data, 0o644); err != nil {
			return fmt.Errorf("release: %w", err)
		}
	}
	return nil
}

// trackedFiles lists the files of directory mdir of the git working tree at
// root that git tracks or would track (untracked files that no .gitignore
// excludes), relative to mdir.
func trackedFiles(root, mdir string) ([]string, error) {
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", mdir)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("release: git ls-files in %s: %w: %s", root, err, strings.TrimSpace(stderr.String()))
	}
	prefix := ""
	if mdir != "." {
		prefix = mdir + "/"
	}
	var names []string
	seen := map[string]bool{}
	for _, name := range strings.Split(string(out), "\x00") {
		if name == "" || seen[name] {
			continue
		}
		seen[name] = true
		if !strings.HasPrefix(name, prefix) {
			return nil, fmt.Errorf("release: git listed %q outside %s", name, mdir)
		}
		names = append(names, strings.TrimPrefix(name, prefix))
	}
	slices.Sort(names)
	return names, nil
}

type diskFile struct {
	name, full string
	info       fs.FileInfo
}

func (f diskFile) Path() string                 { return f.name }
func (f diskFile) Lstat() (fs.FileInfo, error)  { return f.info, nil }
func (f diskFile) Open() (io.ReadCloser, error) { return os.Open(f.full) }

type dataFile struct {
	name string
	data []byte
}

func (f dataFile) Path() string                 { return f.name }
func (f dataFile) Lstat() (fs.FileInfo, error)  { return dataInfo(f), nil }
func (f dataFile) Open() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(f.data)), nil }

type dataInfo dataFile

func (fi dataInfo) Name() string       { return path.Base(fi.name) }
func (fi dataInfo) Size() int64        { return int64(len(fi.data)) }
func (fi dataInfo) Mode() fs.FileMode  { return 0o644 }
func (fi dataInfo) ModTime() time.Time { return time.Time{} }
func (fi dataInfo) IsDir() bool        { return false }
func (fi dataInfo) Sys() any           { return nil }

// zipNames returns the names in a module zip, for tests.
func zipNames(data []byte) ([]string, error) {
	r, err := zip.NewReader(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		return nil, err
	}
	var names []string
	for _, f := range r.File {
		names = append(names, f.Name)
	}
	return names, nil
}
