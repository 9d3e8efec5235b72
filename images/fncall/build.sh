#!/usr/bin/env bash
# Builds the FnCall image (Debian 12 minbase + python3, numpy, g++, nodejs): the same builder
# and cache rules as images/debian (see its build.sh), with ./packages.
# Usage: build.sh [--install] [--print-dir] [--force]
exec "$(dirname "${BASH_SOURCE[0]}")/../debian/build.sh" --name fncall "$@"
