#!/usr/bin/env bash
# Schema check of the Kubernetes manifests, offline:
#   1. renders the kustomization (`kubectl kustomize`, else the plain files);
#   2. validates every resource with `kubernetes-validate --strict` (PyPI package that bundles the
#      Kubernetes OpenAPI schemas; installed into target/k8s-validate-venv on first use) against
#      the oldest and newest Kubernetes versions we claim (1.30, 1.37): unknown fields fail;
#   3. checks that the validator does reject a bad manifest (so a green run means something);
#   4. checks that every VGPU_* variable the manifests set is documented in docs/configuration.md;
#   5. checks that nothing runs with --insecure: the manifests are mutual TLS only;
#   6. validates the DRA driver (deploy/k8s/dra: kustomization, examples/, and the ResourceSlice
#      the driver publishes, dra/resourceslice-example.yaml, which a unit test of vgpu-dra keeps
#      equal to the driver's output) against 1.36 and 1.37, the versions with resource.k8s.io/v1
#      consumable capacity.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv="${VGPU_K8S_VENV:-$PWD/target/k8s-validate-venv}"
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  echo "installing kubernetes-validate into $venv..." >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet kubernetes-validate
fi
validate="$venv/bin/kubernetes-validate"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rendered="$work/all.yaml"
if command -v kubectl >/dev/null 2>&1; then
  kubectl kustomize deploy/k8s >"$rendered"
else
  echo "kubectl not found: validating the files without kustomize" >&2
  for file in deploy/k8s/*.yaml; do
    [ "$(basename "$file")" = kustomization.yaml ] && continue
    cat "$file"
    echo "---"
  done >"$rendered"
fi

for version in 1.30.0 1.37.0; do
  "$validate" --strict --quiet -k "$version" "$rendered"
done
echo "kubernetes-validate --strict: $(grep -c '^kind:' "$rendered") resources pass against 1.30 and 1.37"
dra="$work/dra.yaml"
if command -v kubectl >/dev/null 2>&1; then
  kubectl kustomize deploy/k8s/dra >"$dra"
else
  for file in deploy/k8s/dra/*.yaml; do
    case "$(basename "$file")" in kustomization.yaml | resourceslice-example.yaml) continue ;; esac
    cat "$file"
    echo "---"
  done >"$dra"
fi
# The second stage (dra-control-plane: an agent DaemonSet on the Kubernetes-managed nodes and a
# patch of the driver's DaemonSet, itself a complete DaemonSet so that it is checked without
# kustomize too).
stage2="$work/dra-control-plane.yaml"
if command -v kubectl >/dev/null 2>&1; then
  kubectl kustomize deploy/k8s/dra-control-plane >"$stage2"
else
  for file in deploy/k8s/dra-control-plane/*.yaml; do
    [ "$(basename "$file")" = kustomization.yaml ] && continue
    cat "$file"
    echo "---"
  done >"$stage2"
fi
dra_all="$work/dra-all.yaml"
{ cat "$dra"; echo "---"; cat "$stage2"; } >"$dra_all"
# The examples and the published slice are checked for their schema only: they are not deployed
# with the driver (the VGPU_* and insecure checks below cover what is).
examples="$work/dra-examples.yaml"
for file in deploy/k8s/dra/examples/*.yaml deploy/k8s/dra/resourceslice-example.yaml; do
  cat "$file"
  echo "---"
done >"$examples"
for version in 1.36.0 1.37.0; do
  "$validate" --strict --quiet -k "$version" "$dra_all" "$examples"
done
echo "kubernetes-validate --strict: $(cat "$dra_all" "$examples" | grep -cE '^kind:|^  "kind":') DRA resources (both stages), examples and the published slice pass against 1.36 and 1.37"

# The validator must fail on a misspelt field.
sed 's/^  serviceName: vgpu-cp$/  serviceNmae: vgpu-cp/' "$rendered" >"$work/bad.yaml"
if "$validate" --strict --quiet "$work/bad.yaml" >/dev/null 2>&1; then
  echo "validate.sh: the validator accepted a misspelt field; the check is not working" >&2
  exit 1
fi

missing=0
while read -r variable; do
  if ! grep -q "\`$variable\`" docs/configuration.md; then
    echo "validate.sh: $variable is set in deploy/k8s but not documented in docs/configuration.md" >&2
    missing=1
  fi
done < <(cat "$rendered" "$dra_all" | grep -o 'VGPU_[A-Z_]*' | sort -u)
[ "$missing" = 0 ]
echo "every VGPU_* variable in the manifests is documented"

if cat "$rendered" "$dra_all" | grep -n -i 'insecure' | grep -v '^[0-9]*: *#' >&2; then
  echo "validate.sh: the lines above turn on plain text; the manifests run with mutual TLS only" >&2
  exit 1
fi
echo "nothing runs with --insecure"
