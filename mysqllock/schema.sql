-- dlock lease table for MySQL 5.7+ / MariaDB 10.3+.
-- Apply with mysqllock.(*Backend).Migrate or `dlock migrate`; rows are kept
-- after release so that each key's fencing counter never goes back.
-- Migrate also adds the last three columns of the lease table, and the
-- last two of the session table, to tables created without them.
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
-- session; this row keeps each key's fencing counter and its last holder.
CREATE TABLE IF NOT EXISTS `dlock_locks_session` (
  name        VARBINARY(255)  NOT NULL,
  token       BINARY(16)      NOT NULL,
  owner       VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  fence       BIGINT UNSIGNED NOT NULL,
  conn_id     BIGINT UNSIGNED NOT NULL,                 -- CONNECTION_ID() of the holder's session
  lock_name   VARCHAR(64)     CHARACTER SET utf8mb4 NOT NULL DEFAULT '',  -- GET_LOCK name ('' for rowlock)
  acquired_at DATETIME(6)     NOT NULL,
  metadata    VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  delay_us    BIGINT UNSIGNED NOT NULL DEFAULT 0,       -- lock-delay of the last grant while neither released nor spent
  delay_until DATETIME(6)     NOT NULL DEFAULT '1970-01-01 00:00:00', -- UTC, server clock; no grant before
  PRIMARY KEY (name)
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
