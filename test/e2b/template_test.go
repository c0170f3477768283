package e2b_test

import "testing"

// TestTemplateBuild builds a template with the SDK's Template.build on
// dsec's image builder and starts sandboxes of it (kind container: the
// built image's layers).
func TestTemplateBuild(t *testing.T) {
	needNode(t)
	s := server(t)
	scenario(t, s, "template-build", templates("container")...)
}
