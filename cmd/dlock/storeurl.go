package main

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// storeSpec is a parsed and checked store URL: everything openStore needs,
// found without I/O.
type storeSpec struct {
	scheme   string     // mysql, postgres, redis, etcd, zk or sqlite
	u        *url.URL   // nil for the embedded store
	params   url.Values // checked: known names, one non-empty value each
	path     string     // the SQLite file
	embedded bool       // no store was named: this host's embedded SQLite store
	name     string     // the URL for messages: no password
	secrets  []string   // passwords in the URL, never to be printed
	// pwParam: the query has a password parameter. A password there that
	// was not percent-encoded may have been cut into names and values, so
	// messages show none of the query.
	pwParam bool
}

// strategy returns the strategy parameter, or the store's default.
func (s *storeSpec) strategy() string {
	if v := s.params.Get("strategy"); v != "" {
		return v
	}
	switch s.scheme {
	case "mysql", "postgres":
		return "lease"
	}
	return ""
}

// The parameters each scheme accepts. PostgreSQL also accepts pgx's
// connection and pool parameters and the settings application_name,
// search_path and options; any other name would reach the server as a
// setting.
var (
	mysqlParams = []string{"strategy", "table", "doorbell"}
	pgParams    = []string{"strategy", "table",
		"application_name", "channel_binding", "connect_timeout", "default_query_exec_mode",
		"description_cache_capacity", "krbspn", "krbsrvname", "max_protocol_version",
		"min_protocol_version", "options", "passfile", "password", "pool_health_check_period",
		"pool_max_conn_idle_time", "pool_max_conn_lifetime", "pool_max_conn_lifetime_jitter",
		"pool_max_conns", "pool_min_conns", "pool_min_idle_conns", "require_auth", "search_path",
		"service", "servicefile", "sslcert", "sslcertmode", "sslkey", "sslmode", "sslnegotiation",
		"sslpassword", "sslrootcert", "sslsni", "statement_cache_capacity", "target_session_attrs"}
	redisParams = []string{"prefix", "min_replicas",
		"client_name", "conn_max_idle_time", "conn_max_lifetime", "context_timeout_enabled", "db",
		"dial_timeout", "max_idle_conns", "max_redirects", "max_retries", "max_retry_backoff",
		"min_idle_conns", "min_retry_backoff", "pool_fifo", "pool_size", "pool_timeout",
		"protocol", "read_timeout", "skip_verify", "write_timeout"}
	etcdParams = []string{"prefix"}
	zkParams   = []string{"root", "session"}
	strategies = map[string][]string{"mysql": {"lease", "getlock", "rowlock"}, "postgres": {"lease", "advisory"}}
)

const storeForms = "mysql://, postgres://, redis://, etcd://, zk:// or sqlite://"

var schemeRE = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]{0,19}$`)

// parseStore parses raw, the store URL from source ("--db" or "$DLOCK_DB";
// "" when neither was set). An explicitly empty URL is an error: it is
// usually an unset variable, and falling back to the per-host embedded store
// would let every host run the job. No message shows any part of a password:
// where the URL does not parse as written, nothing after the scheme is shown.
func parseStore(raw, source string) (*storeSpec, error) {
	if raw == "" {
		if source != "" {
			return nil, usageError("%s is empty (an unset variable?): give a store URL, or unset it to use this host's embedded store", source)
		}
		return &storeSpec{embedded: true, scheme: "sqlite"}, nil
	}
	scheme, rest, ok := strings.Cut(raw, "://")
	if s, _, _ := strings.Cut(raw, ":"); !ok && strings.EqualFold(s, "sqlite") {
		// sqlite:path has no password to hide.
		return nil, usageError("bad store URL %q: want an absolute path after three slashes, as in sqlite:///var/lib/dlock/locks.db", raw)
	}
	if !ok || !schemeRE.MatchString(scheme) {
		if s, _, ok := strings.Cut(raw, ":"); ok && schemeRE.MatchString(s) {
			// scheme:user:pass@host/db: show the scheme alone.
			return nil, usageError("bad store URL %s:… (the rest is not shown: it may hold a password): write %s://… as in mysql://user:pass@host:3306/db", s, s)
		}
		return nil, usageError("bad store URL (not shown: it may hold a password): want %s", storeForms)
	}
	scheme = strings.ToLower(scheme)
	switch scheme {
	case "mysql", "sqlite", "redis", "rediss", "etcd":
	case "postgres", "postgresql":
		scheme = "postgres"
	case "zk", "zookeeper":
		scheme = "zk"
	default:
		return nil, usageError("unknown store %q (want %s)", scheme, storeForms)
	}
	if scheme != "sqlite" {
		// Where a '/', '?' or '#' comes before the last '@', the password
		// would be cut in two and a part of it read as host, path or
		// parameters (and shown in messages).
		if at := strings.LastIndexByte(rest, '@'); at >= 0 && strings.ContainsAny(rest[:at], "/?#") {
			return nil, usageError("bad %s store URL (not shown: it may hold a password): a '/', '?', '#' or '@' in a user name, password or parameter must be percent-encoded (%%2F, %%3F, %%23, %%40)", scheme)
		}
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, usageError("bad %s store URL (not shown: it may hold a password): %s; percent-encode special characters in the password", scheme, urlErrText(err))
	}
	if strings.Contains(raw, "#") {
		return nil, usageError("bad %s store URL (not shown: it may hold a password): a '#' must be percent-encoded as %%23", scheme)
	}
	spec := &storeSpec{scheme: scheme, u: u}
	if pw, ok := u.User.Password(); ok && pw != "" {
		spec.secrets = append(spec.secrets, pw)
	}
	params, err := url.ParseQuery(u.RawQuery)
	for _, m := range passwordParamRE.FindAllStringSubmatch(u.RawQuery, -1) {
		spec.pwParam = true
		spec.secrets = append(spec.secrets, m[1])
		if v, err := url.QueryUnescape(m[1]); err == nil {
			spec.secrets = append(spec.secrets, v)
		}
	}
	spec.name = spec.redacted()
	if err != nil {
		return nil, usageError("bad parameters in %s: %s", spec.name, urlErrText(err))
	}
	known := map[string][]string{"mysql": mysqlParams, "postgres": pgParams, "redis": redisParams,
		"rediss": redisParams, "etcd": etcdParams, "zk": zkParams, "sqlite": nil}[scheme]
	names := make([]string, 0, len(params))
	for k := range params {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		vs := params[k]
		switch {
		case !slices.Contains(known, k):
			return nil, usageError("unknown parameter %s in %s (known: %s)", spec.show(k), spec.name, strings.Join(known, ", "))
		case len(vs) > 1:
			return nil, usageError("parameter %s given %d times in %s", spec.show(k), len(vs), spec.name)
		case vs[0] == "":
			return nil, usageError("parameter %s is empty in %s (an unset variable?)", spec.show(k), spec.name)
		}
	}
	spec.params = params
	if want, ok := strategies[scheme]; ok {
		if s := params.Get("strategy"); s != "" && !slices.Contains(want, s) {
			return nil, usageError("unknown strategy %s in %s (want %s)", spec.show(s), spec.name, strings.Join(want, ", "))
		}
	}
	switch scheme {
	case "sqlite":
		// sqlite://rel/path reads as host "rel": refused, as is any path that
		// is not absolute, rather than resolved against whatever directory
		// dlock happens to run in.
		if u.Host != "" || u.Opaque != "" || !filepath.IsAbs(u.Path) {
			return nil, usageError("%s is not an absolute path: want three slashes, as in sqlite:///var/lib/dlock/locks.db", spec.name)
		}
		spec.path = u.Path
		if strings.HasSuffix(spec.path, "/") {
			return nil, usageError("no file in %s (want sqlite:///path/to/locks.db)", spec.name)
		}
	case "mysql":
		if trimSlash(u.Path) == "" {
			return nil, usageError("no database in %s (want mysql://user:pass@host:3306/db)", spec.name)
		}
		if v := params.Get("doorbell"); v != "" {
			if s := params.Get("strategy"); s != "" && s != "lease" {
				return nil, usageError("doorbell applies to the lease strategy, not %s, in %s", s, spec.name)
			}
			if _, port, err := net.SplitHostPort(v); v != "off" && (err != nil || port == "") {
				return nil, usageError("bad doorbell %s in %s (want off, or host:port of one node)", spec.show(v), spec.name)
			}
		}
	case "zk":
		if v := params.Get("session"); v != "" {
			if d, err := time.ParseDuration(v); err != nil || d <= 0 {
				return nil, usageError("bad session timeout %s in %s (want a duration such as 30s)", spec.show(v), spec.name)
			}
		}
	case "redis", "rediss":
		if v := params.Get("min_replicas"); v != "" {
			if n, err := strconv.Atoi(v); err != nil || n < 0 {
				return nil, usageError("bad min_replicas %s in %s (want a number of replicas, 0 or more)", spec.show(v), spec.name)
			}
		}
		if _, err := redis.ParseURL(goRedisURL(u, params)); err != nil {
			return nil, usageError("%s: %s", spec.name, spec.scrub(redactErr(err).Error()))
		}
	}
	if scheme != "sqlite" && u.Host == "" {
		return nil, usageError("no server in %s", spec.name)
	}
	for _, h := range strings.Split(u.Host, ",") {
		if h == "" && scheme != "sqlite" {
			return nil, usageError("no server in %s", spec.name)
		}
	}
	return spec, nil
}

// dlockRedisParams are the redis:// parameters that dlock reads itself;
// go-redis reads the others.
var dlockRedisParams = []string{"prefix", "min_replicas"}

// goRedisURL is u with only the parameters go-redis reads.
func goRedisURL(u *url.URL, params url.Values) string {
	q := url.Values{}
	for k, v := range params {
		if !slices.Contains(dlockRedisParams, k) {
			q[k] = v
		}
	}
	u2 := *u
	u2.RawQuery = q.Encode()
	return u2.String()
}

// redacted is the URL for messages: without the password of its user info
// or of the password and sslpassword parameters (which pgx accepts).
func (s *storeSpec) redacted() string {
	u2 := *s.u
	if _, err := url.ParseQuery(u2.RawQuery); err != nil || s.pwParam {
		u2.RawQuery = "…"
	}
	return s.scrub(u2.Redacted())
}

// show quotes a name or value from the query for a message, or hides it
// when the query has a password parameter.
func (s *storeSpec) show(v string) string {
	if s.pwParam {
		return "(not shown: the URL has a password parameter)"
	}
	return fmt.Sprintf("%q", v)
}

// minScrub is the shortest password that scrub looks for in messages: a
// shorter one would hit ordinary words. Messages are built not to contain
// passwords; scrub is a second line of defence.
const minScrub = 4

// scrub replaces the URL's passwords in msg.
func (s *storeSpec) scrub(msg string) string { return scrubSecrets(msg, s.secrets) }

// scrubSecrets replaces in msg each secret of at least minScrub bytes, as
// written, URL-escaped or escaped inside a Go-quoted string, longest first.
func scrubSecrets(msg string, secrets []string) string {
	var forms []string
	for _, p := range secrets {
		if len(p) < minScrub {
			continue
		}
		q := strconv.Quote(p)
		forms = append(forms, p, url.QueryEscape(p), url.PathEscape(p), q[1:len(q)-1])
	}
	slices.SortStableFunc(forms, func(a, b string) int { return len(b) - len(a) })
	for _, f := range forms {
		msg = strings.ReplaceAll(msg, f, "xxxxx")
	}
	return msg
}

// urlErrText is a *url.Error's reason without the quoted input it names,
// which may be a part of a password ("invalid port \":Top\" after host").
func urlErrText(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	msg := quotedRE.ReplaceAllString(err.Error(), "")
	return strings.Join(strings.Fields(msg), " ")
}

var passwordParamRE = regexp.MustCompile(`(?:^|[&?])(?:password|sslpassword)=([^&#]*)`)

var quotedRE = regexp.MustCompile(`"(?:[^"\\]|\\.)*"`)

func trimSlash(p string) string { return strings.TrimLeft(p, "/") }

// redactErr drops a *url.Error's URL, which may carry a password.
func redactErr(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// urlSecrets returns what may be passwords in the store URLs among args,
// parsed or not: the text between the user name and each '@' after it (a
// password may hold '@'), and the values of password parameters.
func urlSecrets(args []string) []string {
	var out []string
	add := func(p string) {
		out = append(out, p)
		if d, err := url.PathUnescape(p); err == nil && d != p {
			out = append(out, d)
		}
	}
	for _, arg := range args {
		_, rest, ok := strings.Cut(arg, "://")
		if !ok {
			continue
		}
		for at := range len(rest) {
			if rest[at] != '@' {
				continue
			}
			if _, pw, ok := strings.Cut(rest[:at], ":"); ok {
				add(pw)
			}
		}
		for _, m := range passwordParamRE.FindAllStringSubmatch(rest, -1) {
			add(m[1])
		}
	}
	return out
}
