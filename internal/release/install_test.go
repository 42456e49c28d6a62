package release

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// repoRoot is the repository's root, two directories above this package.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// need ends a test that cannot run without the executable name: under
// CI=true the test fails, otherwise it is skipped with the reason.
func need(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is required (CI=true): %v", name, err)
		}
		t.Skipf("SKIPPING: %s is not installed: %v", name, err)
	}
	return p
}

// readmeProgram returns the README's complete example: the first ```go
// block that is a main package.
func readmeProgram(t *testing.T, root string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile("(?s)```go\n(.*?)```").FindAllSubmatch(data, -1) {
		if bytes.HasPrefix(m[1], []byte("package main\n")) {
			return m[1]
		}
	}
	t.Fatal("README.md has no ```go block that starts with package main: the install test compiles it")
	return nil
}

// TestInstallAsAUser installs dlock the way a user would once the release's
// tags exist: every published module of this working tree goes into a file
// module proxy at the version the go.mod files require, and in an empty
// module outside the workspace `go get …/mysqllock@VERSION` alone must build
// the README's example, and `go install …/cmd/dlock@VERSION` must give a
// working CLI. Third-party modules come from the module cache or from the
// proxy in the environment's GOPROXY.
func TestInstallAsAUser(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the CLI from a module proxy (a minute or more): not with -short")
	}
	goBin := need(t, "go")
	need(t, "git")
	root := repoRoot(t)
	version, err := RequiredVersion(root)
	if err != nil {
		t.Fatal(err)
	}

	proxy := t.TempDir()
	if err := Publish(root, proxy, version); err != nil {
		t.Fatal(err)
	}

	goEnv := func(name string) string {
		out, err := exec.Command(goBin, "env", name).Output()
		if err != nil {
			t.Fatalf("go env %s: %v", name, err)
		}
		return strings.TrimSpace(string(out))
	}
	// The user's module cache is a fresh one, so that nothing published
	// here reaches the real cache (a later run would take the stale copy);
	// the real cache serves as a proxy for what it holds.
	proxies := []string{"file://" + proxy, "file://" + filepath.Join(goEnv("GOMODCACHE"), "cache", "download")}
	if up := goEnv("GOPROXY"); up != "" {
		proxies = append(proxies, up)
	}
	work := t.TempDir()
	user := filepath.Join(work, "app")
	bin := filepath.Join(work, "bin")
	if err := os.Mkdir(user, 0o755); err != nil {
		t.Fatal(err)
	}
	env := append(slices.DeleteFunc(os.Environ(), func(kv string) bool {
		k, _, _ := strings.Cut(kv, "=")
		return strings.HasPrefix(k, "GO") && k != "GOCACHE" && k != "GOPATH" && k != "GOROOT" && k != "GOTMPDIR"
	}),
		"GOWORK=off",
		"GOTOOLCHAIN=local",
		"GOPROXY="+strings.Join(proxies, ","),
		"GOMODCACHE="+filepath.Join(work, "modcache"),
		// -trimpath keeps the build cache's keys free of the temporary
		// module cache's path, so a second run reuses the compiled
		// dependencies; -modcacherw lets the temporary directory go.
		"GOFLAGS=-modcacherw -trimpath",
		// The released versions exist only in the file proxy: the
		// checksum database has never seen them.
		"GONOSUMDB="+Path,
		"GOPRIVATE=",
		"GONOPROXY=",
		"GOBIN="+bin,
	)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	run := func(dir string, name string, args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir = dir
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", filepath.Base(name), strings.Join(args, " "), err, out)
		}
		return string(out)
	}

	run(user, goBin, "mod", "init", "example.com/app")
	run(user, goBin, "get", Path+"/mysqllock@"+version)
	if err := os.WriteFile(filepath.Join(user, "main.go"), readmeProgram(t, root), 0o644); err != nil {
		t.Fatal(err)
	}
	run(user, goBin, "vet", ".")
	run(user, goBin, "build", "-o", filepath.Join(work, "app.exe"), ".")
	gomod, err := os.ReadFile(filepath.Join(user, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{Path + " " + version, Path + "/mysqllock " + version} {
		if !bytes.Contains(gomod, []byte(want)) {
			t.Errorf("the user's go.mod lacks %q:\n%s", want, gomod)
		}
	}
	// A MySQL user never downloads another store's client.
	for _, line := range lines(gomod) {
		for _, other := range []string{"etcd", "grpc", "redis", "pgx", "zookeeper", "sqlite", "opentelemetry"} {
			if strings.Contains(line, other) {
				t.Errorf("go get of mysqllock brought in %q", line)
			}
		}
	}

	// The OpenTelemetry observer installs on its own, at the same version.
	otelApp := filepath.Join(work, "otelapp")
	if err := os.Mkdir(otelApp, 0o755); err != nil {
		t.Fatal(err)
	}
	run(otelApp, goBin, "mod", "init", "example.com/otelapp")
	run(otelApp, goBin, "get", Path+"/dlockotel@"+version)
	if err := os.WriteFile(filepath.Join(otelApp, "main.go"), []byte(otelProgram), 0o644); err != nil {
		t.Fatal(err)
	}
	run(otelApp, goBin, "mod", "tidy")
	run(otelApp, goBin, "vet", ".")
	if out := run(otelApp, goBin, "run", "."); !strings.Contains(out, "observed fence 1") {
		t.Errorf("the dlockotel program printed %q, want \"observed fence 1\"", out)
	}

	run(work, goBin, "install", Path+"/cmd/dlock@"+version)
	dlock := filepath.Join(bin, "dlock")
	out := run(work, dlock, "version")
	t.Logf("installed: %s", strings.TrimSpace(out))
	db := "sqlite://" + filepath.Join(work, "locks.db")
	out = run(work, dlock, "run", "--db", db, "install-test", "--", "sh", "-c", `echo "held $DLOCK_KEY"`)
	if !strings.Contains(out, "held install-test") {
		t.Errorf("dlock run: got %q, want the command's output", out)
	}
}

// otelProgram wires dlockotel to a Locker over memlock, with otel's
// global (no-op) providers.
const otelProgram = `package main

import (
	"context"
	"fmt"
	"log"

	"github.com/dlock-dev/dlock"
	"github.com/dlock-dev/dlock/dlockotel"
	"github.com/dlock-dev/dlock/memlock"
)

func main() {
	ctx := context.Background()
	obs, err := dlockotel.New()
	if err != nil {
		log.Fatal(err)
	}
	locker := dlock.New(memlock.New(), &dlock.Options{Observer: obs})
	defer locker.Close(ctx)
	lk, err := locker.TryAcquire(ctx, "k")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("observed fence", lk.Fence())
	if err := lk.Release(ctx); err != nil {
		log.Fatal(err)
	}
}
`

func lines(b []byte) []string {
	var out []string
	s := bufio.NewScanner(bytes.NewReader(b))
	for s.Scan() {
		out = append(out, s.Text())
	}
	return out
}
