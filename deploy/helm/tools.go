//go:build tools

// Package helm only pins the helm command that `make test` builds from the module
// proxy (Debian 12 has no helm package): deploy/helm/build.sh builds it.
package helm

import (
	_ "helm.sh/helm/v4/cmd/helm"
)
