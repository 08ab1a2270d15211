#!/usr/bin/env bash
# Two `comb serve` replicas sharing one Redis behind HAProxy (docs/deploy/haproxy.cfg), on loopback:
# round robin, a document read across replicas from Redis, tenants apart, a replica killed mid-run,
# Redis stopped. Prints each check and the figures (docs/serving.md, "Replicas behind a load balancer").
#   bench/replicas.sh [COMB_BINARY]   (default build/comb; needs redis-server and haproxy: Debian's packages)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
comb=${1:-$root/build/comb}
redis=${COMB_REDIS_SERVER:-$(command -v redis-server || echo /usr/bin/redis-server)}
haproxy=$(command -v haproxy || echo /usr/sbin/haproxy)
[ -x "$haproxy" ] || { echo "$0: haproxy not found (Debian: apt-get install haproxy)" >&2; exit 1; }
py=${COMB_VENV:-$root/.venv}/bin/python
exec "$py" "$root/tests/serve/test_replicas.py" "$comb" "$redis" "$haproxy"
