package release

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/mod/modfile"
)

// Every module of the repository is either published or development-only,
// and go.work uses each of them: a new module needs that decision.
func TestEveryModuleIsListed(t *testing.T) {
	root := repoRoot(t)
	var found []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), "_")) {
			return filepath.SkipDir
		}
		if d.Name() == "go.mod" {
			rel, err := filepath.Rel(root, filepath.Dir(p))
			if err != nil {
				return err
			}
			found = append(found, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	listed := slices.Concat(Published, Development)
	slices.Sort(found)
	slices.Sort(listed)
	if !slices.Equal(found, listed) {
		t.Errorf("modules in the tree %q, listed in Published and Development %q", found, listed)
	}

	data, err := os.ReadFile(filepath.Join(root, "go.work"))
	if err != nil {
		t.Fatal(err)
	}
	wf, err := modfile.ParseWork("go.work", data, nil)
	if err != nil {
		t.Fatal(err)
	}
	var used []string
	for _, u := range wf.Use {
		used = append(used, strings.TrimPrefix(filepath.ToSlash(filepath.Clean(u.Path)), "./"))
	}
	slices.Sort(used)
	if !slices.Equal(used, listed) {
		t.Errorf("go.work uses %q, want every module %q", used, listed)
	}
}

// The tree is in its released shape: the modules agree on one version of
// their siblings with no replace directive, every go.mod has the root's go
// directive, and go.work replaces each library module at that version.
func TestTreeIsReleasable(t *testing.T) {
	root := repoRoot(t)
	version, err := RequiredVersion(root)
	if err != nil {
		t.Fatal(err)
	}
	goVersion := func(dir string) string {
		data, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(dir), "go.mod"))
		if err != nil {
			t.Fatal(err)
		}
		f, err := modfile.Parse(dir+"/go.mod", data, nil)
		if err != nil {
			t.Fatal(err)
		}
		if f.Go == nil {
			t.Fatalf("%s/go.mod has no go directive", dir)
		}
		return f.Go.Version
	}
	want := goVersion(".")
	for _, dir := range slices.Concat(Published, Development) {
		if got := goVersion(dir); got != want {
			t.Errorf("%s/go.mod says go %s, the root says go %s", dir, got, want)
		}
		data, _ := os.ReadFile(filepath.Join(root, filepath.FromSlash(dir), "go.mod"))
		out, err := ReleaseGoMod(data, version)
		if err != nil {
			t.Fatal(err)
		}
		if string(out) != string(data) {
			t.Errorf("%s/go.mod is not as `dlock-release set-version %s` leaves it", dir, version)
		}
	}
	work, err := os.ReadFile(filepath.Join(root, "go.work"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := ReleaseGoWork(work, version)
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != string(work) {
		t.Errorf("go.work is not as `dlock-release set-version %s` leaves it:\n%s", version, out)
	}
}

func TestReleaseGoMod(t *testing.T) {
	in := `module github.com/dlock-dev/dlock/cmd/dlock

go 1.26.0

require (
	github.com/dlock-dev/dlock v0.0.0
	github.com/dlock-dev/dlock/mysqllock v0.0.0-00010101000000-000000000000
	github.com/go-sql-driver/mysql v1.10.1
)

replace (
	github.com/dlock-dev/dlock => ../../
	github.com/dlock-dev/dlock/mysqllock => ../../mysqllock
	example.com/other => ../other
)
`
	want := `module github.com/dlock-dev/dlock/cmd/dlock

go 1.26.0

require (
	github.com/dlock-dev/dlock v0.2.0
	github.com/dlock-dev/dlock/mysqllock v0.2.0
	github.com/go-sql-driver/mysql v1.10.1
)

replace example.com/other => ../other
`
	out, err := ReleaseGoMod([]byte(in), "v0.2.0")
	if err != nil {
		t.Fatal(err)
	}
	if string(out) != want {
		t.Errorf("got\n%s\nwant\n%s", out, want)
	}
	for _, bad := range []string{"0.2.0", "v0.2", "v0.2.0+meta", "latest"} {
		if _, err := ReleaseGoMod([]byte(in), bad); !errors.Is(err, ErrVersion) {
			t.Errorf("version %q: got %v, want ErrVersion", bad, err)
		}
	}
}

func TestReleaseGoWork(t *testing.T) {
	in := `go 1.26.0

use (
	.
	./mysqllock
)

replace github.com/dlock-dev/dlock v0.1.0 => ./

replace example.com/other => ../other
`
	out, err := ReleaseGoWork([]byte(in), "v0.2.0")
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	if strings.Contains(s, "v0.1.0") || !strings.Contains(s, "example.com/other => ../other") {
		t.Errorf("old replaces not dropped, or a foreign one dropped:\n%s", s)
	}
	for _, dir := range Published {
		line := ModulePath(dir) + " v0.2.0 => ./" + strings.TrimPrefix(dir, ".")
		if got := strings.Contains(s, line); got != (dir != "cmd/dlock") {
			t.Errorf("replace %q present: %v\n%s", line, got, s)
		}
	}
}

// A module zip holds the tracked files, the released go.mod, the root's
// LICENSE, and nothing of nested modules or ignored files.
func TestPublishZipContents(t *testing.T) {
	need(t, "git")
	root := repoRoot(t)
	dir := t.TempDir()
	if err := publishModule(root, dir, "mysqllock", "v0.9.9"); err != nil {
		t.Fatal(err)
	}
	if err := publishModule(root, dir, ".", "v0.9.9"); err != nil {
		t.Fatal(err)
	}
	read := func(name string) []byte {
		data, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(name)))
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	names, err := zipNames(read("github.com/dlock-dev/dlock/mysqllock/@v/v0.9.9.zip"))
	if err != nil {
		t.Fatal(err)
	}
	prefix := "github.com/dlock-dev/dlock/mysqllock@v0.9.9/"
	for _, want := range []string{"go.mod", "mysqllock.go", "schema.sql", "LICENSE"} {
		if !slices.Contains(names, prefix+want) {
			t.Errorf("mysqllock's zip lacks %s: %q", want, names)
		}
	}
	if mod := string(read("github.com/dlock-dev/dlock/mysqllock/@v/v0.9.9.mod")); !strings.Contains(mod, Path+" v0.9.9") || strings.Contains(mod, "replace") {
		t.Errorf("released go.mod:\n%s", mod)
	}
	names, err = zipNames(read("github.com/dlock-dev/dlock/@v/v0.9.9.zip"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		rel := strings.TrimPrefix(n, Path+"@v0.9.9/")
		if top, _, _ := strings.Cut(rel, "/"); slices.Contains([]string{"mysqllock", "cmd", "torture", "bench"}, top) {
			t.Errorf("the root module's zip holds %s, from a nested module", n)
		}
	}
	if !slices.Contains(names, Path+"@v0.9.9/locktest/locktest.go") {
		t.Errorf("the root module's zip lacks locktest: %q", names)
	}
}
