-- pg_rewind connects to the new primary as the replication role (with its client
-- certificate), not as the superuser: these are the functions it reads the source's
-- files with (PostgreSQL's documentation of pg_rewind, "a role with ... EXECUTE on").
-- The role exists before migrations run (the instance manager makes the roles first).
grant execute on function pg_catalog.pg_ls_dir(text, boolean, boolean) to streaming_replica;
grant execute on function pg_catalog.pg_stat_file(text, boolean) to streaming_replica;
grant execute on function pg_catalog.pg_read_binary_file(text) to streaming_replica;
grant execute on function pg_catalog.pg_read_binary_file(text, bigint, bigint, boolean) to streaming_replica;
