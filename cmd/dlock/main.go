// Command dlock runs a command under a distributed lock and administers
// locks. See `dlock --help`.
package main

import "os"

func main() { os.Exit(newApp(os.Stdout, os.Stderr).main(os.Args[1:])) }
