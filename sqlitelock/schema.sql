-- dlock lease tables for SQLite 3.42+ (the embedded default store).
-- Apply with sqlitelock.(*Backend).Migrate or `dlock migrate`. A key's row in
-- dlock_locks is kept after release so that its fencing counter, shared by
-- every mode, never goes back.
CREATE TABLE IF NOT EXISTS "dlock_locks" (
  name        TEXT    NOT NULL PRIMARY KEY,  -- the key, byte for byte (BINARY collation)
  token       BLOB    NOT NULL,              -- random owner token of the exclusive holder
  owner       TEXT    NOT NULL DEFAULT '',
  fence       INTEGER NOT NULL,              -- fencing counter: each acquisition in any mode sets max(fence + 1, now in µs)
  acquired_us INTEGER NOT NULL,              -- Unix µs, host clock read by SQLite
  expires_us  INTEGER NOT NULL,              -- Unix µs; past = no exclusive holder
  metadata    TEXT    NOT NULL DEFAULT '',
  writer_us   INTEGER NOT NULL DEFAULT 0,    -- Unix µs; until then new shared requests wait for a writer
  freed_us    INTEGER NOT NULL DEFAULT 0,    -- Unix µs of the key's last release in any mode; 0 = none recorded
  jseq        INTEGER NOT NULL DEFAULT 0     -- position of the key's last change in dlock_journal
) WITHOUT ROWID;
-- Shared and limited holders, one row each; a row goes at its release.
CREATE TABLE IF NOT EXISTS "dlock_shares" (
  name        TEXT    NOT NULL,              -- the key, as in dlock_locks
  token       BLOB    NOT NULL,              -- random owner token of the holder
  owner       TEXT    NOT NULL DEFAULT '',
  fence       INTEGER NOT NULL,              -- from the key's counter in dlock_locks
  acquired_us INTEGER NOT NULL,
  expires_us  INTEGER NOT NULL,              -- Unix µs; past = free
  metadata    TEXT    NOT NULL DEFAULT '',
  mode        TEXT    NOT NULL CHECK (mode IN ('shared', 'limited')),
  lim         INTEGER NOT NULL DEFAULT 0,    -- the key's holder limit, for 'limited'
  PRIMARY KEY (name, token)
) WITHOUT ROWID;
-- The change journal that watchers of a key's holders read
-- (dlock.HolderWatcher): an entry per change of the key's holders, numbered
-- per key without gaps (dlock_locks.jseq), written by the triggers below in
-- the transaction that makes the change, whichever client makes it. An
-- entry replaces one of the same number left over from a dropped lock
-- table; watchers read none past jseq. Only a
-- key's last 256 entries are kept: a watcher further behind starts again.
CREATE TABLE IF NOT EXISTS "dlock_journal" (
  name        TEXT    NOT NULL,              -- the key, as in dlock_locks
  seq         INTEGER NOT NULL,              -- the key's position after the change
  kind        TEXT    NOT NULL,              -- x: the exclusive holder after it (empty token: none);
                                             -- g, r, m: a shared or limited holder granted, gone, its metadata set
  token       BLOB    NOT NULL,
  owner       TEXT    NOT NULL DEFAULT '',
  fence       INTEGER NOT NULL DEFAULT 0,
  acquired_us INTEGER NOT NULL DEFAULT 0,
  expires_us  INTEGER NOT NULL DEFAULT 0,    -- at the change; extensions are not journaled
  metadata    TEXT    NOT NULL DEFAULT '',
  mode        TEXT    NOT NULL DEFAULT '',
  lim         INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (name, seq)
) WITHOUT ROWID;
-- A grant of the exclusive lease, its release, its metadata change, and a
-- shared or limited grant's clearing of the row's holder. An extension
-- changes only expires_us and is not a change of holders.
CREATE TRIGGER IF NOT EXISTS "dlock_locks_journal_insert" AFTER INSERT ON "dlock_locks" BEGIN
  UPDATE "dlock_locks" SET jseq = jseq + 1 WHERE name = NEW.name;
  INSERT OR REPLACE INTO "dlock_journal" (name, seq, kind, token, owner, fence, acquired_us, expires_us, metadata)
    SELECT name, jseq, 'x', iif(length(token) > 0 AND expires_us > 0, token, x''), owner, fence, acquired_us, expires_us, metadata
    FROM "dlock_locks" WHERE name = NEW.name;
END;
CREATE TRIGGER IF NOT EXISTS "dlock_locks_journal_update" AFTER UPDATE OF token, fence, metadata, expires_us ON "dlock_locks"
WHEN NEW.fence <> OLD.fence OR NEW.token <> OLD.token OR NEW.metadata <> OLD.metadata OR (NEW.expires_us = 0 AND OLD.expires_us <> 0)
BEGIN
  UPDATE "dlock_locks" SET jseq = jseq + 1 WHERE name = NEW.name;
  INSERT OR REPLACE INTO "dlock_journal" (name, seq, kind, token, owner, fence, acquired_us, expires_us, metadata)
    SELECT name, jseq, 'x', iif(length(token) > 0 AND expires_us > 0, token, x''), owner, fence, acquired_us, expires_us, metadata
    FROM "dlock_locks" WHERE name = NEW.name;
  DELETE FROM "dlock_journal" WHERE name = NEW.name AND seq <= (SELECT jseq FROM "dlock_locks" WHERE name = NEW.name) - 256;
END;
CREATE TRIGGER IF NOT EXISTS "dlock_shares_journal_insert" AFTER INSERT ON "dlock_shares" BEGIN
  UPDATE "dlock_locks" SET jseq = jseq + 1 WHERE name = NEW.name;
  INSERT OR REPLACE INTO "dlock_journal" (name, seq, kind, token, owner, fence, acquired_us, expires_us, metadata, mode, lim)
    SELECT NEW.name, jseq, 'g', NEW.token, NEW.owner, NEW.fence, NEW.acquired_us, NEW.expires_us, NEW.metadata, NEW.mode, NEW.lim
    FROM "dlock_locks" WHERE name = NEW.name;
  DELETE FROM "dlock_journal" WHERE name = NEW.name AND seq <= (SELECT jseq FROM "dlock_locks" WHERE name = NEW.name) - 256;
END;
CREATE TRIGGER IF NOT EXISTS "dlock_shares_journal_delete" AFTER DELETE ON "dlock_shares" BEGIN
  UPDATE "dlock_locks" SET jseq = jseq + 1 WHERE name = OLD.name;
  INSERT OR REPLACE INTO "dlock_journal" (name, seq, kind, token)
    SELECT OLD.name, jseq, 'r', OLD.token FROM "dlock_locks" WHERE name = OLD.name;
  DELETE FROM "dlock_journal" WHERE name = OLD.name AND seq <= (SELECT jseq FROM "dlock_locks" WHERE name = OLD.name) - 256;
END;
CREATE TRIGGER IF NOT EXISTS "dlock_shares_journal_metadata" AFTER UPDATE OF metadata ON "dlock_shares"
WHEN NEW.metadata <> OLD.metadata
BEGIN
  UPDATE "dlock_locks" SET jseq = jseq + 1 WHERE name = NEW.name;
  INSERT OR REPLACE INTO "dlock_journal" (name, seq, kind, token, metadata)
    SELECT NEW.name, jseq, 'm', NEW.token, NEW.metadata FROM "dlock_locks" WHERE name = NEW.name;
  DELETE FROM "dlock_journal" WHERE name = NEW.name AND seq <= (SELECT jseq FROM "dlock_locks" WHERE name = NEW.name) - 256;
END;
