-- dlock lease table for MySQL 5.7+ / MariaDB 10.3+.
-- Apply with mysqllock.(*Backend).Migrate or `dlock migrate`; rows are kept
-- after release so that each key's fencing counter never goes back.
CREATE TABLE IF NOT EXISTS `dlock_locks` (
  name        VARBINARY(255)  NOT NULL,                 -- the key, byte for byte
  token       BINARY(16)      NOT NULL,                 -- random owner token of the holder
  owner       VARCHAR(255)    CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  fence       BIGINT UNSIGNED NOT NULL,                 -- fencing counter, +1 per acquisition
  acquired_at DATETIME(6)     NOT NULL,                 -- UTC, server clock
  expires_at  DATETIME(6)     NOT NULL,                 -- UTC, server clock; past = free
  metadata    VARCHAR(1024)   CHARACTER SET utf8mb4 NOT NULL DEFAULT '',
  PRIMARY KEY (name)
) ENGINE=InnoDB;
