"""The team topology as plain processes on one machine (up.sh, down.sh) and the local S3 server it and the tests use."""
