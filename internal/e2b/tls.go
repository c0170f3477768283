package e2b

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/dsec/internal/errdefs"
)

// CA file names in the directory TLSConfig keeps its own CA in.
const (
	CACertFile = "e2b-ca.pem"
	caKeyFile  = "e2b-ca.key"
)

// TLSConfig is the TLS configuration of a listener serving the sandbox
// domain (https://<port>-<sandbox id>.<domain>, and the API at
// https://api.<domain>): the certificate in certFile and keyFile, or, when
// both are empty, one for <domain> and *.<domain> issued at each call by a
// CA of dsec's own, kept in caDir (CACertFile, created with its key on
// first use). Clients that are to trust it add that PEM file to their
// roots (NODE_EXTRA_CA_CERTS for Node, SSL_CERT_FILE for Python). domain
// may carry a port, which is ignored here.
func TLSConfig(domain, certFile, keyFile, caDir string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
	if certFile != "" || keyFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("load the E2B TLS certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
		return cfg, nil
	}
	host := domainHost(domain)
	if host == "" {
		return nil, errdefs.Invalid("a TLS listener for E2B without a certificate needs the sandbox domain (e2b.domain) to issue one for")
	}
	if net.ParseIP(host) != nil {
		return nil, errdefs.Invalid("the sandbox domain %q is an IP address: <port>-<id>.<domain> would not be a host name", host)
	}
	ca, caKey, err := loadOrCreateCA(caDir)
	if err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "*." + host},
		DNSNames:     []string{host, "*." + host},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(1, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("issue the E2B TLS certificate: %w", err)
	}
	cfg.Certificates = []tls.Certificate{{Certificate: [][]byte{der, ca.Raw}, PrivateKey: key}}
	return cfg, nil
}

// domainHost is the domain without a port, lowercase.
func domainHost(domain string) string {
	if h, _, err := net.SplitHostPort(domain); err == nil {
		domain = h
	}
	return strings.ToLower(strings.TrimSuffix(domain, "."))
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// loadOrCreateCA reads dir's CA, creating it (valid ten years) when
// missing. The key is written before the certificate, so a certificate
// file always has its key.
func loadOrCreateCA(dir string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	certPath, keyPath := filepath.Join(dir, CACertFile), filepath.Join(dir, caKeyFile)
	certPEM, err := os.ReadFile(certPath)
	if err == nil {
		keyPEM, err := os.ReadFile(keyPath)
		if err != nil {
			return nil, nil, fmt.Errorf("read the E2B CA key: %w", err)
		}
		return parseCA(certPEM, keyPEM)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "dsec E2B sandbox domain CA", Organization: []string{"dsec"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tpl, tpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
	certPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := writeNew(keyPath, keyPEM, 0o600); err != nil {
		return nil, nil, err
	}
	if err := writeNew(certPath, certPEM, 0o644); err != nil {
		return nil, nil, err
	}
	return parseCA(certPEM, keyPEM)
}

func parseCA(certPEM, keyPEM []byte) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, nil, errors.New("the E2B CA files are not PEM")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("parse the E2B CA: %w", err)
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, nil, fmt.Errorf("parse the E2B CA key: %w", err)
	}
	return cert, key, nil
}

// writeNew writes a file that must not exist yet.
func writeNew(path string, b []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
