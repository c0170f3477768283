package trajectory

import (
	"bytes"
	"encoding/json"
)

func jsonCompact(dst *bytes.Buffer, src []byte) error { return json.Compact(dst, src) }
