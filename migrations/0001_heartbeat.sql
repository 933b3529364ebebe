-- Castellan's own schema in every managed cluster. The primary's instance manager
-- writes the single heartbeat row every second; a replica's lag in seconds is the age
-- of the row it has replayed, which stays meaningful when the database is idle.
create schema if not exists castellan;

create table if not exists castellan.heartbeat (
    id integer primary key default 1 check (id = 1),
    written_at timestamptz not null
);
