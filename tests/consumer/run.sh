#!/usr/bin/env bash
# Builds tests/consumer/main.cpp two ways a trainer would: with swapopt as a Meson subproject, and
# against an installed swapopt found through pkg-config. Prints "tests: N passed, M failed, 0 skipped".
# Usage: tests/consumer/run.sh BUILD_DIR   (an already built swapopt build directory to install)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "$1" && pwd)
work=$(mktemp -d)
passed=0
failed=0
check() {  # name, command...
  local name=$1
  shift
  if "$@"; then passed=$((passed + 1)); echo "consumer $name: ok"; else failed=$((failed + 1)); echo "consumer $name: FAILED"; fi
}

# 1. Subproject: a copy of the consumer with subprojects/swapopt pointing at this tree.
cp -r "$here/subproject" "$work/subproject"
cp "$here/main.cpp" "$work/main.cpp"
mkdir -p "$work/subproject/subprojects"
ln -s "$root" "$work/subproject/subprojects/swapopt"
sub() {
  meson setup "$work/subproject/build" "$work/subproject" >"$work/sub.log" 2>&1 &&
    ninja -C "$work/subproject/build" >>"$work/sub.log" 2>&1 &&
    "$work/subproject/build/consumer"
}
check subproject sub || tail -20 "$work/sub.log"
# As a subproject of a debug parent: the library compiled optimised (its CUDA kernels too: nvcc's
# -G, which a debug build type adds, turns device optimisation off), nothing but the library
# built, and portable code (no AVX-512 without native_arch).
optimised() {
  python3 - "$work/subproject/build/compile_commands.json" <<'PY'
import json, sys
lib = [c for c in json.load(open(sys.argv[1])) if any(f"/subprojects/swapopt/{d}/" in c["file"] for d in ("lib", "kernels"))]
slow = [c["file"] for c in lib if " -O3" not in c["command"] or " -G " in c["command"] + " "]
print(f"{len(lib)} library sources, {len(slow)} without -O3 or with -G")
sys.exit(1 if not lib or slow else 0)
PY
}
check "subproject library optimised under a debug parent" optimised
only_library() {
  ! ninja -C "$work/subproject/build" -t targets all | grep -E -q 'swapopt-(tests|bench|train|hsdp|smoke)'
}
check "subproject builds only the library" only_library
# The consumer's program links as the C++ program it is: Meson links a target with nvcc when a
# library it links has CUDA sources of its own (swapopt's kernels are a library taken whole).
cpp_linked() {
  grep -E '^build consumer: [a-z]+_LINKER' "$work/subproject/build/build.ninja" | grep -q '^build consumer: cpp_LINKER'
}
check "subproject's program linked by the C++ linker" cpp_linked
portable() {
  local zmm
  zmm=$(objdump -d "$work/subproject/build/subprojects/swapopt/libswapopt.so" | grep -c zmm)
  echo "zmm instructions in the default library: $zmm"
  [ "$zmm" -eq 0 ]
}
check "default library without AVX-512" portable
# The parent's `meson install` takes the shared library its program needs and its licence, nothing
# else of swapopt.
installs_only_library() {
  python3 - "$work/subproject/build" <<'PY'
import json, os, subprocess, sys
installed = json.loads(subprocess.run(["meson", "introspect", "--installed", sys.argv[1]], check=True,
                                      capture_output=True, text=True).stdout)
swapopt = [to for source, to in installed.items() if "/subprojects/swapopt/" in source]
licence = [to for to in swapopt if to.endswith("/doc/swapopt/LICENSE")]
other = [to for to in swapopt if not os.path.basename(to).startswith("libswapopt.so") and to not in licence]
print(f"subproject installs {len(swapopt)} files, {len(licence)} licence, {len(other)} besides the shared library: {other}")
sys.exit(1 if len(swapopt) == len(licence) or len(licence) != 1 or other else 0)
PY
}
check "subproject installs only the shared library and its licence" installs_only_library
# Installed (into a staging root), the program finds the library through its run path alone.
installed_program_runs() {
  DESTDIR="$work/subroot" meson install -C "$work/subproject/build" --no-rebuild >"$work/subinstall.log" 2>&1 ||
    { tail -20 "$work/subinstall.log"; return 1; }
  local program
  program=$(find "$work/subroot" -name consumer -type f | head -1)
  [ -n "$program" ] && env -u LD_LIBRARY_PATH "$program"
}
check "subproject's installed program runs" installed_program_runs

# 2. Installed: meson install into a staging root, found through pkg-config.
cp -r "$here/pkgconfig" "$work/pkgconfig"
installed() {
  DESTDIR="$work/root" meson install -C "$build" --no-rebuild >"$work/install.log" 2>&1 || return 1
  local pc
  pc=$(dirname "$(find "$work/root" -name swapopt.pc | head -1)")
  local lib
  lib=$(dirname "$(find "$work/root" -name 'libswapopt.so' | head -1)")
  PKG_CONFIG_PATH="$pc" PKG_CONFIG_SYSROOT_DIR="$work/root" meson setup "$work/pkgconfig/build" "$work/pkgconfig" \
    >"$work/pkg.log" 2>&1 &&
    ninja -C "$work/pkgconfig/build" >>"$work/pkg.log" 2>&1 &&
    LD_LIBRARY_PATH="$lib" "$work/pkgconfig/build/consumer"
}
check pkg-config installed || tail -20 "$work/pkg.log" "$work/install.log"
# The same install linked statically with the README's command: `pkg-config --static --libs`
# (libswapopt.a picked with -l:), and the program needs no libswapopt.so.
static_linked() {
  local pc root_lib
  pc=$(dirname "$(find "$work/root" -name swapopt.pc | head -1)")
  root_lib=$(dirname "$(find "$work/root" -name 'libswapopt.a' | head -1)")
  local cflags libs
  cflags=$(PKG_CONFIG_PATH="$pc" PKG_CONFIG_SYSROOT_DIR="$work/root" pkg-config --cflags swapopt) || return 1
  libs=$(PKG_CONFIG_PATH="$pc" PKG_CONFIG_SYSROOT_DIR="$work/root" pkg-config --static --libs swapopt) || return 1
  echo "pkg-config --static --libs swapopt: $libs"
  c++ -std=c++20 "$work/main.cpp" $cflags -o "$work/consumer-static" ${libs/-lswapopt/-l:libswapopt.a} >"$work/static.log" 2>&1 ||
    { tail -20 "$work/static.log"; return 1; }
  ! ldd "$work/consumer-static" | grep -q libswapopt && "$work/consumer-static"
}
check "pkg-config --static" static_linked
# --cflags carries swapopt's include dir alone: no dependency's headers leak into a consumer.
cflags_only_swapopt() {
  local pc flags
  pc=$(dirname "$(find "$work/root" -name swapopt.pc | head -1)")
  flags=$(PKG_CONFIG_PATH="$pc" pkg-config --cflags swapopt)
  echo "pkg-config --cflags swapopt: $flags"
  [ "$(echo "$flags" | wc -w)" -eq 1 ]
}
check "pkg-config --cflags only swapopt's" cflags_only_swapopt
# The installed programs start from the staging root with no loader path set (the rpath is
# relative to them), and the licence and a SONAME with the 0.x minor version are installed.
installed_programs_start() {
  local train
  train=$(find "$work/root" -name swapopt-train -type f | head -1)
  [ -n "$train" ] || { echo "no swapopt-train installed"; return 1; }
  env -u LD_LIBRARY_PATH "$train" --help >/dev/null
}
check "installed programs find the library" installed_programs_start
licence_and_soname() {
  local lib soname version
  lib=$(find "$work/root" -name 'libswapopt.so' | head -1)
  soname=$(readelf -d "$lib" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
  version=$(sed -n "s/^  version: '\([0-9]*\)\.\([0-9]*\)\..*/\1.\2/p" "$root/meson.build")
  echo "SONAME $soname (project version $version)"
  [ "$soname" = "libswapopt.so.${version%%.*}" ] && [ "${version%%.*}" != 0 ] ||
    [ "$soname" = "libswapopt.so.$version" ] || return 1
  find "$work/root" -path '*/doc/swapopt/LICENSE' | grep -q .
}
check "licence and SONAME installed" licence_and_soname
# The install moved elsewhere (a relocated package or a copied prefix, the staging root deleted):
# pkg-config's paths follow the .pc file, and the programs still find the library.
moved_prefix() {
  local prefix_dir pc cflags libs libdir train
  prefix_dir=$(dirname "$(dirname "$(find "$work/root" -path '*/include/swapopt' -type d | head -1)")")
  mkdir -p "$work/moved" && mv "$prefix_dir" "$work/moved/swapopt-0" && rm -rf "$work/root" || return 1
  pc=$(dirname "$(find "$work/moved" -name swapopt.pc | head -1)")
  cflags=$(PKG_CONFIG_PATH="$pc" pkg-config --cflags swapopt) || return 1
  libs=$(PKG_CONFIG_PATH="$pc" pkg-config --libs swapopt) || return 1
  libdir=$(realpath "$(PKG_CONFIG_PATH="$pc" pkg-config --variable=libdir swapopt)")
  echo "moved: pkg-config --cflags --libs swapopt: $cflags $libs"
  c++ -std=c++20 "$work/main.cpp" $cflags -o "$work/consumer-moved" $libs -Wl,-rpath,"$libdir" \
    >"$work/moved.log" 2>&1 || { tail -20 "$work/moved.log"; return 1; }
  train=$(find "$work/moved" -name swapopt-train -type f | head -1)
  # A runtime-only copy of the prefix has no pkgconfig folder: the rpath must not run through it.
  mv "$pc" "$pc.gone"
  env -u LD_LIBRARY_PATH "$work/consumer-moved" && env -u LD_LIBRARY_PATH "$train" --help >/dev/null
}
check "installed prefix moved" moved_prefix

rm -rf "$work"
echo "tests: $passed passed, $failed failed, 0 skipped"
[ "$failed" -eq 0 ]
