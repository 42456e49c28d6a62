package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/dlock-dev/dlock"
	"github.com/spf13/cobra"
)

// exitNoLeader is dlock leader's status when nobody leads.
const exitNoLeader = 1

// jsonLeader is a leader in dlock leader --json.
type jsonLeader struct {
	Key       string     `json:"key"`
	Value     string     `json:"value"`
	Fence     uint64     `json:"fence"` // 0: nobody leads
	Since     *time.Time `json:"since,omitempty"`
	ExpiresAt *time.Time `json:"expires_at,omitempty"`
}

func (a *app) leaderCmd() *cobra.Command {
	var asJSON, watch bool
	cmd := &cobra.Command{
		Use:   "leader KEY",
		Short: "Show the leader of an election, or follow it",
		Long: `leader prints the value and fence of the current leader of the election on
KEY (a process that called Election.Campaign, or a dlock run holding KEY, whose
value is its metadata). It exits 1 when nobody leads. With --watch it prints
the leader, then a line for every change of the leader or its value until it
is interrupted; a line with fence 0 says that nobody leads. A new leader
always has a greater fence than the one before.`,
		Example: `  dlock leader scheduler
  dlock leader scheduler --watch --json`,
		Args: cobra.ExactArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			key := args[0]
			if err := dlock.ValidateKey(key); err != nil {
				return usageError("%w", err)
			}
			s, err := a.openStore(a.ctx, false)
			if err != nil {
				return err
			}
			defer s.close()
			e := dlock.NewElection(dlock.New(s.backend, nil), key)
			show := func(ld dlock.Leader) error {
				if asJSON {
					j := jsonLeader{Key: key, Value: ld.Value, Fence: ld.Fence}
					if ld.Fence != 0 {
						since := ld.Since.UTC()
						j.Since = &since
						if !ld.ExpiresAt.IsZero() {
							exp := ld.ExpiresAt.UTC()
							j.ExpiresAt = &exp
						}
					}
					b, err := json.Marshal(j)
					if err != nil {
						return err
					}
					_, err = fmt.Fprintf(a.stdout, "%s\n", b)
					return err
				}
				if ld.Fence == 0 {
					_, err := fmt.Fprintf(a.stdout, "0\t-\t(no leader)\n")
					return err
				}
				_, err := fmt.Fprintf(a.stdout, "%d\t%s\t%s\n", ld.Fence, ld.Since.Local().Format(listTime), printable(ld.Value))
				return err
			}
			if !watch {
				ld, err := e.Leader(a.ctx)
				switch {
				case errors.Is(err, dlock.ErrNoLeader):
					fmt.Fprintf(a.stderr, "dlock: nobody leads %q\n", key)
					return &exitError{code: exitNoLeader}
				case errors.Is(err, dlock.ErrUnsupported):
					return usageError("%s cannot list holders: %w", s.name, err)
				case err != nil:
					return a.storeErr(s, err)
				}
				return show(ld)
			}
			for ld := range e.Observe(a.ctx) {
				if err := show(ld); err != nil {
					return failure(err)
				}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON (one object per line with --watch)")
	cmd.Flags().BoolVar(&watch, "watch", false, "print every change of the leader until interrupted")
	return cmd
}
