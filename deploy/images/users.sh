#!/bin/sh
# mmdebstrap --essential-hook of deploy/images/build.sh: the users Castellan's pods run
# as, with fixed ids, written before any package that would create them installs.
#
# - postgres, uid and gid 26: the operator runs every database pod with
#   runAsUser/runAsGroup/fsGroup 26 (CASTELLAN_POSTGRES_UID/GID, the ids Red Hat's and
#   CloudNativePG's images use). Debian's postgresql-common would create postgres with
#   the next free system uid (100-ish, different per package set); it keeps a user that
#   already exists. Debian's base-passwd gives gid 26 to the group `tape`, which has no
#   use in a container image: it goes, so that gid 26 reads as `postgres`.
# - nonroot, uid and gid 65532: the operator's Deployment runs as 65532 (the distroless
#   convention); a name for it keeps tools that look the user up (and people) happy.
#
# The essential variant has no useradd (passwd is not Essential), so the entries are
# written directly; no shadow entries: neither user has a password.
set -eu
root="$1"
for f in group gshadow; do
  [ ! -e "$root/etc/$f" ] || sed -i '/^tape:/d' "$root/etc/$f"
done
if grep -q '^[^:]*:[^:]*:26:' "$root/etc/group" || grep -q '^[^:]*:[^:]*:26:' "$root/etc/passwd"; then
  echo "users.sh: uid or gid 26 is already taken in the image: $(grep ':26:' "$root/etc/passwd" "$root/etc/group")" >&2
  exit 1
fi
cat >>"$root/etc/group" <<'EOF'
postgres:x:26:
nonroot:x:65532:
EOF
cat >>"$root/etc/passwd" <<'EOF'
postgres:x:26:26:PostgreSQL administrator:/var/lib/postgresql:/bin/bash
nonroot:x:65532:65532:Castellan operator:/nonexistent:/usr/sbin/nologin
EOF
