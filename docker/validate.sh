#!/usr/bin/env bash
# Validates the deployment files as far as a machine without a Docker engine or a cluster
# allows (CI runs it from .ci/run):
#   docker-compose config   compose.yaml against the Compose schema (Debian's docker-compose)
#   promtool check config   prometheus/prometheus.yml (Debian's prometheus)
#   kubectl kustomize       k8s/ builds (kubectl when present)
#   kubernetes-validate     every manifest against the Kubernetes 1.37 schemas, strict
#                           (PyPI kubernetes-validate, schemas bundled: no network)
#   the dashboard JSON parses; the structural checks of every file: tests/deploy.rs,
#   tests/dashboard.rs.
# Not validated here: building the image (no Docker engine), Grafana loading the dashboard
# (not packaged in Debian), the ServiceMonitor against its CRD, anything on a real cluster.
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
docker-compose -f compose.yaml config -q
echo "validate: compose.yaml ok"
promtool check config prometheus/prometheus.yml >/dev/null
echo "validate: prometheus.yml ok"
python3 -c 'import json,sys; json.load(open(sys.argv[1]))' grafana/dashboards/tokengate.json
echo "validate: dashboard JSON ok"
files=(k8s/configmap.yaml k8s/deployment.yaml k8s/service.yaml k8s/engines.yaml k8s-cluster/redis.yaml k8s-cluster/configmap.yaml)
if command -v kubectl >/dev/null 2>&1; then
  kubectl kustomize k8s >"$tmp/kustomized.yaml"
  kubectl kustomize k8s-cluster >"$tmp/kustomized-cluster.yaml"
  files+=("$tmp/kustomized.yaml" "$tmp/kustomized-cluster.yaml")
  echo "validate: kubectl kustomize k8s and k8s-cluster ok"
else
  echo "validate: no kubectl, kustomization not built"
fi
python3 -m kubernetes_validate --strict --quiet "${files[@]}"
echo "validate: Kubernetes manifests ok (strict, $(python3 -m kubernetes_validate --version))"
