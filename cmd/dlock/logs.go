package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"

	"github.com/go-sql-driver/mysql"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// newLogger returns dlock's logger: silent unless verbose, then every level
// in format "text" or "json" (slog's handlers) on w.
func newLogger(w io.Writer, verbose bool, format string) (*slog.Logger, error) {
	level := slog.LevelError + 1 // silent
	if verbose {
		level = slog.LevelDebug
	}
	opts := &slog.HandlerOptions{Level: level}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, usageError("--log-format %q: want text or json", format)
}

// routeDriverLogs sends the log lines of the store clients that log through
// package-level loggers (the MySQL driver, go-redis) to log, so that none
// reaches stderr on its own, unformatted. The etcd and ZooKeeper clients
// get theirs when they are opened (zapLogger, zkLogger).
func routeDriverLogs(log *slog.Logger) {
	_ = mysql.SetLogger(mysqlLogger{log.With("driver", "mysql")})
	redis.SetLogger(redisLogger{log.With("driver", "redis")})
}

// driverMessage is a client's log line as one line of text.
func driverMessage(s string) string { return strings.Join(strings.Fields(s), " ") }

type mysqlLogger struct{ log *slog.Logger }

func (l mysqlLogger) Print(v ...any) { l.log.Warn(driverMessage(fmt.Sprint(v...))) }

type redisLogger struct{ log *slog.Logger }

func (l redisLogger) Printf(ctx context.Context, format string, v ...any) {
	l.log.WarnContext(ctx, driverMessage(fmt.Sprintf(format, v...)))
}

type zkLogger struct{ log *slog.Logger }

func (l zkLogger) Printf(format string, v ...any) {
	l.log.Info(driverMessage(fmt.Sprintf(format, v...)))
}

// zapLogger is a zap logger (the etcd client's) that writes to log.
func zapLogger(log *slog.Logger) *zap.Logger { return zap.New(&zapCore{log: log}) }

// zapCore is a zapcore.Core over a slog.Logger.
type zapCore struct {
	log    *slog.Logger
	fields []zapcore.Field
}

func zapLevel(l zapcore.Level) slog.Level {
	switch {
	case l <= zapcore.DebugLevel:
		return slog.LevelDebug
	case l == zapcore.InfoLevel:
		return slog.LevelInfo
	case l == zapcore.WarnLevel:
		return slog.LevelWarn
	}
	return slog.LevelError
}

func (c *zapCore) Enabled(l zapcore.Level) bool {
	return c.log.Enabled(context.Background(), zapLevel(l))
}

func (c *zapCore) With(fs []zapcore.Field) zapcore.Core {
	return &zapCore{log: c.log, fields: append(c.fields[:len(c.fields):len(c.fields)], fs...)}
}

func (c *zapCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

func (c *zapCore) Write(e zapcore.Entry, fs []zapcore.Field) error {
	enc := zapcore.NewMapObjectEncoder()
	for _, f := range append(c.fields[:len(c.fields):len(c.fields)], fs...) {
		f.AddTo(enc)
	}
	attrs := make([]any, 0, 2*len(enc.Fields))
	for k, v := range enc.Fields {
		attrs = append(attrs, k, v)
	}
	c.log.Log(context.Background(), zapLevel(e.Level), driverMessage(e.Message), attrs...)
	return nil
}

func (*zapCore) Sync() error { return nil }
