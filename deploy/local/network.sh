# Loopback address ranges of a local cluster, from its port base (sourced by cluster.sh
# and nodes.sh). Each cluster on one machine needs its own ranges: its nodes' Service
# proxy binds the ClusterIPs and its pods bind their addresses on the host's loopback.
#
# The slot is the port base's ten-thousands digit (16000 → 1, the `make up` cluster;
# 26000 → 2, `make test`'s), from 1 to 5:
#   Service ClusterIPs  127.<95 + slot>.0.0/16             (slot 1: 127.96.0.0/16)
#   pods on node N      127.<100 + 20 × (slot - 1) + N>.x.y (slot 1, node-1: 127.101.x.y)
# so up to 20 nodes per cluster.

castellan_network_slot() { # port-base
  local slot=$(($1 / 10000))
  if ((slot < 1 || slot > 5)); then
    echo "network: error: port base $1 is outside 10000-59999, which gives the address slot" >&2
    return 1
  fi
  echo "$slot"
}

castellan_service_octet() { # port-base
  local slot
  slot="$(castellan_network_slot "$1")" || return 1
  echo $((95 + slot))
}

castellan_pod_octet() { # port-base node-index
  local slot
  slot="$(castellan_network_slot "$1")" || return 1
  (($2 >= 1 && $2 <= 20)) || { echo "network: error: node index $2 is outside 1-20" >&2; return 1; }
  echo $((100 + 20 * (slot - 1) + $2))
}
