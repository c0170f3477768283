package function

import (
	"testing"

	dsecv1 "github.com/opendsec/dsec/api/dsec/v1"
)

func TestJudgeComparisons(t *testing.T) {
	tests := []struct {
		name      string
		got, want string
		opts      *dsecv1.JudgeOptions
		match     bool
	}{
		{"identical output matches", "42\n", "42\n", nil, true},
		{"surrounding whitespace is trimmed", "  42 \r\n", "42", nil, true},
		{"trailing empty lines are ignored", "1\n2\n\n\n", "1\n2", nil, true},
		{"a missing line fails", "1\n", "1\n2\n", nil, false},
		{"inner whitespace counts", "1  2", "1 2", nil, false},
		{"case counts by default", "YES", "yes", nil, false},
		{"case can be ignored", "YES", "yes", &dsecv1.JudgeOptions{CaseInsensitive: true}, true},
		{"floats within tolerance match", "3.14159 2", "3.1416 2", &dsecv1.JudgeOptions{FloatTolerance: 1e-4}, true},
		{"floats outside tolerance fail", "3.15", "3.1416", &dsecv1.JudgeOptions{FloatTolerance: 1e-4}, false},
		{"near zero the tolerance is absolute", "0.0000001", "0", &dsecv1.JudgeOptions{FloatTolerance: 1e-6}, true},
		{"words are not numbers", "abc", "abd", &dsecv1.JudgeOptions{FloatTolerance: 1}, false},
		{"exact mode compares bytes", "42\n", "42", &dsecv1.JudgeOptions{Exact: true}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := matches(tt.got, tt.want, tt.opts); got != tt.match {
				t.Fatalf("matches(%q, %q) = %v", tt.got, tt.want, got)
			}
		})
	}
}
