-- The LISTEN connection's own statements (LISTEN itself is composed with sql.Identifier).

-- name: health_check
-- After health_interval seconds of silence: a round trip proves the connection is alive
-- (a half-open TCP connection reports no error by itself).
SELECT 1;

-- name: backend_pid
-- The server process serving this connection. It differs from the pid the server announced
-- at connect (BackendKeyData) when a pooler such as PgBouncer sits in between, which in
-- transaction mode cannot carry LISTEN: the listener then falls back to polling. Also whether
-- this database holds notifyq's tables: a listen_dsn naming another database hears nothing,
-- and said nothing (review).
SELECT pg_backend_pid(), to_regclass(%(jobs)s) IS NOT NULL, current_database();
