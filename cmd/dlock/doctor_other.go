//go:build !linux

package main

// networkFS names the network filesystem that holds dir; outside Linux it
// cannot tell and returns "".
func networkFS(string) string { return "" }
