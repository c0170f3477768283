package guest

import (
	"errors"
	"fmt"
)

// File metadata: key/value pairs kept with a file as extended attributes
// named MetadataPrefix+key. The namespace is E2B's (envd's), so metadata
// set through the E2B facade, the native API or setfattr inside the
// sandbox is the same.
const (
	// MetadataPrefix is the extended attribute namespace of file metadata.
	MetadataPrefix = "user.e2b."
	// MaxMetadataBytes bounds one file's metadata: names (with the prefix)
	// and values together. ext4 keeps a file's xattrs within one block.
	MaxMetadataBytes = 4096
	// maxMetadataKey is the longest key: the kernel limits an xattr name
	// to 255 bytes.
	maxMetadataKey = 255 - len(MetadataPrefix)
)

// ValidateMetadata checks metadata for a write: keys not empty, keys and
// values printable ASCII (what an HTTP header carries), within the size
// bounds. The error names the offending key.
func ValidateMetadata(md map[string]string) error {
	total := 0
	for k, v := range md {
		if k == "" {
			return errors.New("metadata keys must not be empty")
		}
		if len(k) > maxMetadataKey {
			return fmt.Errorf("metadata key %.40q... is longer than %d bytes", k, maxMetadataKey)
		}
		if !printable(k) {
			return fmt.Errorf("metadata key %q is not printable ASCII", k)
		}
		if !printable(v) {
			return fmt.Errorf("metadata value of key %q is not printable ASCII", k)
		}
		total += len(MetadataPrefix) + len(k) + len(v)
	}
	if total > MaxMetadataBytes {
		return fmt.Errorf("metadata takes %d bytes, more than %d", total, MaxMetadataBytes)
	}
	return nil
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
