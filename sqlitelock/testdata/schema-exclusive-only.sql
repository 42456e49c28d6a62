-- dlock lease table for SQLite 3.42+ (the embedded default store).
-- Apply with sqlitelock.(*Backend).Migrate or `dlock migrate`; rows are kept
-- after release so that each key's fencing counter never goes back.
CREATE TABLE IF NOT EXISTS "dlock_locks" (
  name        TEXT    NOT NULL PRIMARY KEY,  -- the key, byte for byte (BINARY collation)
  token       BLOB    NOT NULL,              -- random owner token of the holder
  owner       TEXT    NOT NULL DEFAULT '',
  fence       INTEGER NOT NULL,              -- fencing counter, +1 per acquisition
  acquired_us INTEGER NOT NULL,              -- Unix µs, host clock read by SQLite
  expires_us  INTEGER NOT NULL,              -- Unix µs; past = free
  metadata    TEXT    NOT NULL DEFAULT ''
) WITHOUT ROWID;
