package cluster

import "context"

var t0 = context.Background()

// SetAfterSend sets a hook run after a retried keyed create's nodes
// answered and before it confirms its claim.
func SetAfterSend(r *Router, f func()) { r.afterSend = f }

// PutClaim writes the claim of key in project: item i on nodes[i].
func (s *Store) PutClaim(project, key string, nodes []string) error {
	c := &claims{s: s, ttl: 3600e9}
	cl, rev, err := c.get(t0, project, key)
	if err != nil {
		return err
	}
	if cl == nil {
		rev = 0
	}
	_, _, err = c.put(t0, project, key, &claim{Nodes: nodes}, rev)
	return err
}
