package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/dlock-dev/dlock"
	"github.com/spf13/cobra"
)

func (a *app) listCmd() *cobra.Command {
	var asJSON, waiters, all bool
	cmd := &cobra.Command{
		Use:   "list [PREFIX]",
		Short: "List held locks, who waits for them, or every key",
		Long: `list shows the locks held on keys starting with PREFIX.

--waiters shows instead the acquisitions waiting for them, where the store
records them (etcd, ZooKeeper, PostgreSQL, MySQL/MariaDB); --all shows every key
the store keeps a record of, free ones too, with the last holder, when it was
released or expired, and the last fencing token (MySQL/MariaDB lease,
PostgreSQL lease, SQLite). A store that cannot tell says so and exits 64.`,
		Example: `  dlock list
  dlock list cron: --json
  dlock list --waiters nightly-
  dlock list --all nightly-report`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			prefix := ""
			if len(args) == 1 {
				prefix = args[0]
			}
			if waiters && all {
				return usageError("--waiters and --all do not go together")
			}
			ctx := a.ctx
			s, err := a.openStore(ctx, false)
			if err != nil {
				return err
			}
			defer s.close()
			switch {
			case waiters:
				return a.listWaiters(ctx, s, prefix, asJSON)
			case all:
				return a.listKeys(ctx, s, prefix, asJSON)
			}
			locks, err := dlock.New(s.backend, nil).List(ctx, prefix)
			if err != nil {
				return a.storeErr(s, err)
			}
			if asJSON {
				return a.printJSON(locks)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "KEY\tMODE\tOWNER\tTOKEN\tACQUIRED\tEXPIRES IN\tMETADATA")
			for _, l := range locks {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", printable(l.Key), listMode(l), orDash(l.Owner), l.Fence,
					l.AcquiredAt.Local().Format(listTime), expiresIn(l), printable(l.Metadata))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().BoolVar(&waiters, "waiters", false, "list who waits for the keys, not who holds them")
	cmd.Flags().BoolVar(&all, "all", false, "list free keys too, with their last holder")
	return cmd
}

// orDash is s for a table cell, printable, or "-" when empty.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return printable(s)
}

// expiresIn is a holder's remaining lease for a table, or "-" for a
// session lock, which lasts as long as its holder's session.
func expiresIn(l dlock.LockInfo) string {
	if l.ExpiresAt.IsZero() {
		return "-"
	}
	return time.Until(l.ExpiresAt).Round(100 * time.Millisecond).String()
}

// listMode is a holder's mode in dlock list's table, one word:
// "exclusive", "shared" or "limited:N".
func listMode(l dlock.LockInfo) string {
	if l.Mode == dlock.ModeLimited {
		return fmt.Sprintf("limited:%d", l.Limit)
	}
	return l.Mode.String()
}

// listTime is the format of times in dlock list's table: local, with the
// zone's offset (--json has RFC 3339 in UTC).
const listTime = "2006-01-02 15:04:05 -07:00"

// printable is s for a terminal: as it is when every character prints,
// else quoted with Go's escapes (\n, \x1b, \u200b), so that a key, owner
// or metadata cannot break the table's lines or send terminal escapes.
func printable(s string) string {
	if s == "" {
		return s
	}
	if !utf8.ValidString(s) || strings.ContainsFunc(s, func(r rune) bool { return !unicode.IsPrint(r) && r != ' ' }) ||
		strings.HasPrefix(s, `"`) {
		return strconv.Quote(s)
	}
	return s
}

type jsonLock struct {
	Key        string    `json:"key"`
	Owner      string    `json:"owner"`
	OwnerToken string    `json:"owner_token"`
	Token      uint64    `json:"token"`
	AcquiredAt time.Time `json:"acquired_at"`
	// ExpiresAt and ExpiresIn are null for session locks, which have no
	// lease (getlock, rowlock, advisory).
	ExpiresAt *time.Time `json:"expires_at"`
	ExpiresIn *float64   `json:"expires_in_seconds"`
	Metadata  string     `json:"metadata"`
	// Mode is "exclusive", "shared" or "limited"; Limit is the key's
	// holder limit when Mode is "limited", absent otherwise.
	Mode  string `json:"mode"`
	Limit int    `json:"limit,omitempty"`
}

func (a *app) printJSON(locks []dlock.LockInfo) error {
	out := make([]jsonLock, len(locks))
	for i, l := range locks {
		out[i] = newJSONLock(l)
	}
	return a.encodeJSON(out)
}

func newJSONLock(l dlock.LockInfo) jsonLock {
	j := jsonLock{Key: l.Key, Owner: l.Owner, OwnerToken: l.Token.String(), Token: l.Fence,
		AcquiredAt: l.AcquiredAt.UTC(), Metadata: l.Metadata, Mode: l.Mode.String()}
	if l.Mode == dlock.ModeLimited {
		j.Limit = l.Limit
	}
	if !l.ExpiresAt.IsZero() {
		at, in := l.ExpiresAt.UTC(), time.Until(l.ExpiresAt).Seconds()
		j.ExpiresAt, j.ExpiresIn = &at, &in
	}
	return j
}

func (a *app) encodeJSON(v any) error {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (a *app) releaseCmd() *cobra.Command {
	var force bool
	return withFlags(&cobra.Command{
		Use:   "release --force KEY",
		Short: "Free a lock whoever holds it (administrative)",
		Long: `release frees KEY whoever holds it (every holder of a --shared or --limit
key). The next holder gets a larger fencing token, so a stale holder is fenced
out; the holder's dlock notices at its next renewal and stops its command. It refuses without --force (exit 64), and
says KEY is free and exits 1 when nothing holds it (with or without
--force).`,
		Example: `  dlock release --force nightly-report`,
		Args:    cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			key := args[0]
			ctx := a.ctx
			s, err := a.openStore(ctx, false)
			if err != nil {
				return err
			}
			defer s.close()
			if !force {
				locks, err := dlock.New(s.backend, nil).List(ctx, key)
				if err != nil && !errors.Is(err, dlock.ErrUnsupported) {
					return a.storeErr(s, err)
				}
				for _, l := range locks {
					if l.Key == key {
						return usageError("refusing to free %q held%s without --force", key, holderDetails(l))
					}
				}
				if err == nil {
					return &exitError{code: 1, err: fmt.Errorf("%q is free: nothing to release", key)}
				}
				return usageError("refusing to free %q without --force", key)
			}
			err = dlock.New(s.backend, nil).ForceRelease(ctx, args[0])
			switch {
			case errors.Is(err, dlock.ErrNotHeld):
				return &exitError{code: 1, err: fmt.Errorf("%q is free: nothing to release", args[0])}
			case err != nil:
				return a.storeErr(s, err)
			}
			fmt.Fprintf(a.stdout, "released %q\n", args[0])
			return nil
		},
	}, func(c *cobra.Command) { c.Flags().BoolVar(&force, "force", false, "really free the lock") })
}

func (a *app) migrateCmd() *cobra.Command {
	var print bool
	return withFlags(&cobra.Command{
		Use:   "migrate",
		Short: "Create the lock tables; say what was created, or that nothing was needed",
		Example: `  dlock migrate --db mysql://admin:secret@db:3306/ops
  dlock migrate --print > schema.sql`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			ctx := a.ctx
			s, err := a.openStore(ctx, true)
			if err != nil {
				return err
			}
			defer s.close()
			if print {
				fmt.Fprint(a.stdout, s.schema)
				if !strings.HasSuffix(s.schema, "\n") {
					fmt.Fprintln(a.stdout)
				}
				return nil
			}
			tables := schemaTables(s.schema)
			before := map[string]bool{}
			if s.exists != nil {
				for _, t := range tables {
					ok, err := bounded(s.guard, ctx, "a table lookup", func(ctx context.Context) (bool, error) { return s.exists(ctx, t) })
					if err != nil {
						return a.storeErr(s, err)
					}
					before[t] = ok
				}
			}
			if err := s.migrate(ctx); err != nil {
				return a.storeErr(s, err)
			}
			var created, existed []string
			for _, t := range tables {
				if before[t] {
					existed = append(existed, unquote(t))
				} else {
					created = append(created, unquote(t))
				}
			}
			switch {
			case s.exists == nil:
				fmt.Fprintf(a.stdout, "nothing to do: %s needs no tables (it answered)\n", s.name)
			case len(created) == 0:
				fmt.Fprintf(a.stdout, "nothing to do: %s has its tables (%s)\n", s.name, strings.Join(existed, ", "))
			default:
				fmt.Fprintf(a.stdout, "created in %s: %s\n", s.name, strings.Join(created, ", "))
			}
			return nil
		},
	}, func(c *cobra.Command) {
		c.Flags().BoolVar(&print, "print", false, "print the SQL instead of running it")
	})
}

func withFlags(c *cobra.Command, f func(*cobra.Command)) *cobra.Command {
	f(c)
	return c
}
