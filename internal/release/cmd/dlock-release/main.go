// Command dlock-release is the part of scripts/release.sh that edits and
// packs modules. Run it from the repository's root:
//
//	go run ./internal/release/cmd/dlock-release set-version v0.1.0   # go.mod requirements and go.work replaces
//	go run ./internal/release/cmd/dlock-release version              # the version the modules require
//	go run ./internal/release/cmd/dlock-release modules              # the directories of the modules to tag
//	go run ./internal/release/cmd/dlock-release publish DIR v0.1.0   # a GOPROXY=file://DIR of the working tree
package main

import (
	"fmt"
	"os"

	"github.com/dlock-dev/dlock/internal/release"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "dlock-release:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	usage := fmt.Errorf("usage: dlock-release set-version VERSION | version | modules | publish DIR VERSION")
	if len(args) == 0 {
		return usage
	}
	switch cmd, args := args[0], args[1:]; {
	case cmd == "set-version" && len(args) == 1:
		return release.SetVersion(".", args[0])
	case cmd == "version" && len(args) == 0:
		v, err := release.RequiredVersion(".")
		if err != nil {
			return err
		}
		fmt.Println(v)
	case cmd == "modules" && len(args) == 0:
		for _, dir := range release.Published {
			fmt.Println(dir)
		}
	case cmd == "publish" && len(args) == 2:
		return release.Publish(".", args[0], args[1])
	default:
		return usage
	}
	return nil
}
