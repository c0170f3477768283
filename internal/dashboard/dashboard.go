// Package dashboard is dsec's web dashboard: static pages embedded in the
// binary, served at /ui/ by `dsec serve` and `dsec api`. The pages are a
// client of the public API like any other: they hold no data, and every
// call they make carries the API key the user typed (kept in the
// browser's session storage), so the dashboard shows what that key may
// see and nothing else (a request without a key gets 401).
package dashboard

import (
	"embed"
	"io/fs"
	"net/http"
)

//go:embed static
var static embed.FS

// Prefix is where the dashboard is served.
const Prefix = "/ui/"

// Handler serves the dashboard's files under Prefix.
func Handler() http.Handler {
	sub, err := fs.Sub(static, "static")
	if err != nil {
		panic(err) // the embedded tree is fixed at build time
	}
	files := http.StripPrefix(Prefix, http.FileServerFS(sub))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Cache-Control", "no-cache")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		// The pages load only their own script and style and talk only to
		// this origin; screenshots come as data URLs.
		h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'")
		files.ServeHTTP(w, r)
	})
}
