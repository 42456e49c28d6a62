-- dlock lease table for MySQL 5.7+ / MariaDB 10.3+.
-- Apply with mysqllock.(*Backend).Migrate or `dlock migrate`; rows are kept
-- after release so that each key's fencing counter never goes back.
-- Migrate also adds the last four columns of the lease table, and the
-- last two of the session table, to tables created without them, converts
-- a session table of an earlier version (InnoDB) to MEMORY, keeping its
-- rows (ALTER TABLE … ENGINE=MEMORY with the max_heap_table_size below),
-- and creates the triggers (at the end: apply them with the mysql client as
-- written, with its DELIMITER) after those columns.
CREATE TABLE IF NOT EXISTS `dlock_locks` (
  name         VARBINARY(255)  NOT NULL,                -- the key, byte for byte
  token        BINARY(16)      NOT NULL,                -- random owner token of the exclusive holder
  owner        VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  fence        BIGINT UNSIGNED NOT NULL,                -- fencing counter, +1 per acquisition in any mode
  acquired_at  DATETIME(6)     NOT NULL,                -- UTC, server clock
  expires_at   DATETIME(6)     NOT NULL,                -- UTC, server clock; past = no exclusive holder
  metadata     VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  shared_until DATETIME(6)     NOT NULL DEFAULT '1970-01-01 00:00:00', -- latest expiry of the shared or limited holders; past = none
  share_limit  INT UNSIGNED    NOT NULL DEFAULT 0,      -- while shared_until is ahead: 0 shared, n limited to n
  writer_until DATETIME(6)     NOT NULL DEFAULT '1970-01-01 00:00:00', -- new shared holders are refused until then
  jseq         BIGINT UNSIGNED NOT NULL DEFAULT 1,      -- position of the key's last change in the journal
  PRIMARY KEY (name)
) ENGINE=InnoDB;

-- The lease strategy's shared and limited holders, each with its own lease;
-- their key's row above is locked (and its fence taken) by every change.
CREATE TABLE IF NOT EXISTS `dlock_locks_holders` (
  name        VARBINARY(255)  NOT NULL,
  token       BINARY(16)      NOT NULL,
  owner       VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  fence       BIGINT UNSIGNED NOT NULL,
  share_limit INT UNSIGNED    NOT NULL,                 -- 0 shared, n limited to n
  acquired_at DATETIME(6)     NOT NULL,
  expires_at  DATETIME(6)     NOT NULL,                 -- past = gone (deleted by the key's next grant)
  metadata    VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  PRIMARY KEY (name, token)
) ENGINE=InnoDB;

-- Session strategies (getlock, rowlock): the lock lives in the holder's
-- session; this row keeps its key's last holder and fencing counter of the
-- server's run. MEMORY, as volatile as the locks themselves: a server
-- restart ends every session lock and empties the table (and with it every
-- pending lock-delay and minimum hold). Fences still grow across restarts:
-- a fence is the run's epoch (below) << 40 | the key's counter. MEMORY rows
-- have a fixed length (~5.7 KB), and the table's size limit is the
-- max_heap_table_size in effect when it is created or altered, 256 MiB
-- (~47,000 keys) here; after a server restart it is that of the first
-- session to open it (the server's max_heap_table_size, unless Migrate runs
-- again). A grant that finds it full restores that limit if it may, and
-- deletes the rows of free keys under a new epoch (see docs/fencing.md).
SET SESSION max_heap_table_size = 268435456;
CREATE TABLE IF NOT EXISTS `dlock_locks_session` (
  name        VARBINARY(255)  NOT NULL,
  token       BINARY(16)      NOT NULL,
  owner       VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  fence       BIGINT UNSIGNED NOT NULL,                 -- epoch << 40 | grants of the key in the server's run
  conn_id     BIGINT UNSIGNED NOT NULL,                 -- CONNECTION_ID() of the holder's session
  lock_name   VARCHAR(64)     CHARACTER SET utf8mb4 NOT NULL DEFAULT '',  -- GET_LOCK name ('' for rowlock)
  acquired_at DATETIME(6)     NOT NULL,
  metadata    VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  delay_us    BIGINT UNSIGNED NOT NULL DEFAULT 0,       -- lock-delay of the last grant while neither released nor spent
  delay_until DATETIME(6)     NOT NULL DEFAULT '1970-01-01 00:00:00', -- UTC, server clock; no grant before
  PRIMARY KEY (name)
) ENGINE=MEMORY;

-- The lease strategy's waits on doorbells: a row per session that waits on
-- a key's doorbell, written by the wait and read by the release that rings
-- the doorbell, which hands the lease to the exclusive waiter it wakes (see
-- the procedures Migrate creates). MEMORY: a restart ends every wait.
CREATE TABLE IF NOT EXISTS `dlock_locks_queue` (
  conn_id  BIGINT UNSIGNED NOT NULL,                    -- CONNECTION_ID() of the waiting session
  name     VARBINARY(255)  NOT NULL,
  token    BINARY(16)      NOT NULL,
  owner    VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  metadata VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  ttl_us   BIGINT UNSIGNED NOT NULL,                    -- the lease asked for; 0: not an exclusive wait
  until    DATETIME(6)     NOT NULL,                    -- UTC, server clock; the wait has ended by then
  PRIMARY KEY (conn_id)
) ENGINE=MEMORY;

-- The session strategies' epoch of the server's run (one row, id 1),
-- emptied by a restart; the first grant of a run bumps the durable counter
-- below and inserts the value it got.
CREATE TABLE IF NOT EXISTS `dlock_locks_run` (
  id    TINYINT UNSIGNED NOT NULL,
  epoch BIGINT UNSIGNED  NOT NULL,
  PRIMARY KEY (id)
) ENGINE=MEMORY;

-- The durable count of the server runs in which a session strategy granted
-- (one row, id 1).
CREATE TABLE IF NOT EXISTS `dlock_locks_epoch` (
  id    TINYINT UNSIGNED NOT NULL,
  epoch BIGINT UNSIGNED  NOT NULL,
  PRIMARY KEY (id)
) ENGINE=InnoDB;

-- rowlock: the rows locked with SELECT … FOR UPDATE, created on demand.
CREATE TABLE IF NOT EXISTS `dlock_locks_rows` (
  name VARBINARY(255) NOT NULL,
  PRIMARY KEY (name)
) ENGINE=InnoDB;

-- The strategy each key is used with (lease, getlock or rowlock), recorded
-- by its first acquisition: the strategies do not exclude each other, so
-- the others refuse the key (mysqllock.ErrOtherStrategy).
CREATE TABLE IF NOT EXISTS `dlock_locks_claims` (
  name     VARBINARY(255) NOT NULL,
  strategy VARCHAR(16)    CHARACTER SET ascii NOT NULL,
  PRIMARY KEY (name)
) ENGINE=InnoDB;

-- The lease strategy's change journal, which watchers of a key's holders
-- read (dlock.HolderWatcher): an entry per change of the key's holders,
-- numbered per key without gaps by the key's jseq (every change holds the
-- key's row lock until it commits, so entries commit in their order),
-- written by the triggers below in the transaction that makes the change,
-- whichever client makes it. An entry replaces one of the same number
-- left over from a dropped lock table; watchers read none past jseq.
-- Only a key's last 256 entries are kept: each
-- change deletes the one 256 before it, by its key (a range would lock the
-- gap before the key's entries, and so stall the neighbouring key).
CREATE TABLE IF NOT EXISTS `dlock_locks_journal` (
  name        VARBINARY(255)  NOT NULL,
  seq         BIGINT UNSIGNED NOT NULL,                 -- the key's jseq after the change
  kind        CHAR(1)         CHARACTER SET ascii NOT NULL, -- x: the exclusive holder after it (zero token: none),
                                                            -- or g, r, m: a shared or limited holder granted, gone, its metadata set
  token       BINARY(16)      NOT NULL,
  owner       VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  fence       BIGINT UNSIGNED NOT NULL DEFAULT 0,
  share_limit INT UNSIGNED    NOT NULL DEFAULT 0,
  acquired_at DATETIME(6)     NOT NULL DEFAULT '1970-01-01 00:00:00',
  expires_at  DATETIME(6)     NOT NULL DEFAULT '1970-01-01 00:00:00', -- at the change; extensions are not journaled
  metadata    VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  PRIMARY KEY (name, seq)
) ENGINE=InnoDB;

-- The journal's triggers. On the lease table: a grant (a new fence), a
-- release (the token cleared), a metadata change; an extension changes
-- only expires_at and is not a change of holders.
DELIMITER //
CREATE TRIGGER `dlock_locks_jbu` BEFORE UPDATE ON `dlock_locks` FOR EACH ROW
  SET NEW.jseq = NEW.jseq + (NEW.fence <> OLD.fence OR NEW.token <> OLD.token
    OR CAST(NEW.metadata AS BINARY) <> CAST(OLD.metadata AS BINARY))//
CREATE TRIGGER `dlock_locks_jau` AFTER UPDATE ON `dlock_locks` FOR EACH ROW
BEGIN
  IF NEW.fence <> OLD.fence OR NEW.token <> OLD.token OR CAST(NEW.metadata AS BINARY) <> CAST(OLD.metadata AS BINARY) THEN
    REPLACE INTO `dlock_locks_journal` (name, seq, kind, token, owner, fence, acquired_at, expires_at, metadata)
    VALUES (NEW.name, NEW.jseq, 'x', IF(NEW.expires_at > UTC_TIMESTAMP(6), NEW.token, X'00000000000000000000000000000000'),
      NEW.owner, NEW.fence, NEW.acquired_at, NEW.expires_at, NEW.metadata);
    IF NEW.jseq > 256 THEN
      DELETE FROM `dlock_locks_journal` WHERE name = NEW.name AND seq = NEW.jseq - 256;
    END IF;
  END IF;
END//
CREATE TRIGGER `dlock_locks_jai` AFTER INSERT ON `dlock_locks` FOR EACH ROW
  REPLACE INTO `dlock_locks_journal` (name, seq, kind, token, owner, fence, acquired_at, expires_at, metadata)
  VALUES (NEW.name, NEW.jseq, 'x', IF(NEW.expires_at > UTC_TIMESTAMP(6), NEW.token, X'00000000000000000000000000000000'),
    NEW.owner, NEW.fence, NEW.acquired_at, NEW.expires_at, NEW.metadata)//
CREATE TRIGGER `dlock_locks_jhi` AFTER INSERT ON `dlock_locks_holders` FOR EACH ROW
BEGIN
  DECLARE j BIGINT UNSIGNED;
  UPDATE `dlock_locks` SET jseq = jseq + 1 WHERE name = NEW.name;
  SELECT jseq INTO j FROM `dlock_locks` WHERE name = NEW.name;
  REPLACE INTO `dlock_locks_journal` (name, seq, kind, token, owner, fence, share_limit, acquired_at, expires_at, metadata)
    VALUES (NEW.name, j, 'g', NEW.token, NEW.owner, NEW.fence, NEW.share_limit, NEW.acquired_at, NEW.expires_at, NEW.metadata);
  IF j > 256 THEN
    DELETE FROM `dlock_locks_journal` WHERE name = NEW.name AND seq = j - 256;
  END IF;
END//
CREATE TRIGGER `dlock_locks_jhu` AFTER UPDATE ON `dlock_locks_holders` FOR EACH ROW
BEGIN
  DECLARE k CHAR(1) CHARACTER SET ascii DEFAULT
    IF(OLD.expires_at > UTC_TIMESTAMP(6) AND NEW.expires_at <= UTC_TIMESTAMP(6), 'r',
      IF(CAST(NEW.metadata AS BINARY) <> CAST(OLD.metadata AS BINARY), 'm', ''));
  DECLARE j BIGINT UNSIGNED;
  IF k <> '' THEN
    UPDATE `dlock_locks` SET jseq = jseq + 1 WHERE name = NEW.name;
    SELECT jseq INTO j FROM `dlock_locks` WHERE name = NEW.name;
    REPLACE INTO `dlock_locks_journal` (name, seq, kind, token, metadata) VALUES (NEW.name, j, k, NEW.token, NEW.metadata);
    IF j > 256 THEN
      DELETE FROM `dlock_locks_journal` WHERE name = NEW.name AND seq = j - 256;
    END IF;
  END IF;
END//
CREATE TRIGGER `dlock_locks_jhd` AFTER DELETE ON `dlock_locks_holders` FOR EACH ROW
BEGIN
  DECLARE j BIGINT UNSIGNED;
  UPDATE `dlock_locks` SET jseq = jseq + 1 WHERE name = OLD.name;
  SELECT jseq INTO j FROM `dlock_locks` WHERE name = OLD.name;
  REPLACE INTO `dlock_locks_journal` (name, seq, kind, token) VALUES (OLD.name, j, 'r', OLD.token);
  IF j > 256 THEN
    DELETE FROM `dlock_locks_journal` WHERE name = OLD.name AND seq = j - 256;
  END IF;
END//
DELIMITER ;
