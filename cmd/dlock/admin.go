package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/spf13/cobra"
)

func (a *app) listCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "list [PREFIX]",
		Short: "List held locks",
		Example: `  dlock list
  dlock list cron: --json`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			prefix := ""
			if len(args) == 1 {
				prefix = args[0]
			}
			ctx := a.ctx
			s, err := a.openStore(ctx, false)
			if err != nil {
				return err
			}
			defer s.close()
			locks, err := dlock.New(s.backend, nil).List(ctx, prefix)
			if err != nil {
				return a.storeErr(s, err)
			}
			if asJSON {
				return a.printJSON(locks)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "KEY\tOWNER\tTOKEN\tACQUIRED\tEXPIRES IN\tMETADATA")
			for _, l := range locks {
				owner := l.Owner
				if owner == "" {
					owner = "-"
				}
				expires := "-" // session locks: as long as the holder's session
				if !l.ExpiresAt.IsZero() {
					expires = time.Until(l.ExpiresAt).Round(100 * time.Millisecond).String()
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", l.Key, owner, l.Fence,
					l.AcquiredAt.Local().Format(time.DateTime), expires, l.Metadata)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
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
}

func (a *app) printJSON(locks []dlock.LockInfo) error {
	out := make([]jsonLock, len(locks))
	for i, l := range locks {
		out[i] = jsonLock{Key: l.Key, Owner: l.Owner, OwnerToken: l.Token.String(), Token: l.Fence,
			AcquiredAt: l.AcquiredAt.UTC(), Metadata: l.Metadata}
		if !l.ExpiresAt.IsZero() {
			at, in := l.ExpiresAt.UTC(), time.Until(l.ExpiresAt).Seconds()
			out[i].ExpiresAt, out[i].ExpiresIn = &at, &in
		}
	}
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func (a *app) releaseCmd() *cobra.Command {
	var force bool
	return withFlags(&cobra.Command{
		Use:   "release --force KEY",
		Short: "Free a lock whoever holds it (administrative)",
		Long: `release frees KEY whoever holds it. The next holder gets a larger fencing
token, so a stale holder is fenced out; the holder's dlock notices at its next
renewal and stops its command. It refuses without --force (exit 64), and
exits 1 when KEY is not held.`,
		Example: `  dlock release --force nightly-report`,
		Args:    cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			if !force {
				return usageError("refusing to free %q held by someone else without --force", args[0])
			}
			ctx := a.ctx
			s, err := a.openStore(ctx, false)
			if err != nil {
				return err
			}
			defer s.close()
			if s.claims != nil {
				err := s.guard.call(ctx, "the strategy check", func(ctx context.Context) error { return s.claims.check(ctx, args[0]) })
				if err != nil {
					return a.storeErr(s, err)
				}
			}
			err = dlock.New(s.backend, nil).ForceRelease(ctx, args[0])
			switch {
			case errors.Is(err, dlock.ErrNotHeld):
				return &exitError{code: 1, err: fmt.Errorf("%q is not held", args[0])}
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
		Short: "Create or upgrade the lock table",
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
			if err := s.migrate(ctx); err != nil {
				return a.storeErr(s, err)
			}
			fmt.Fprintf(a.stdout, "migrated %s\n", s.name)
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
