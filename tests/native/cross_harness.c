/* A command-line driver of the C kernels (fused_cpu.c's entry points and decode_step.c's packed step), so that
 * they can run as a program built for another architecture (tests/ops/test_cross_arch.py: aarch64 under
 * qemu-aarch64, next to x86-64 natively) on the same inputs.
 *
 *   cross_harness IN OUT
 *
 * IN and OUT are streams of little-endian 64-bit words (both targets are LP64 and little-endian, so a
 * pi_call, a pi_buffer and a pi_step_args are laid out the same on each). IN:
 *   magic PIXH_IN, then the buffers: a count, and for each: its bytes, its element size, its role (0: an
 *     input, whose bytes follow, padded to a whole word; 1: an output, filled with 0xff bytes before any call
 *     (a NaN in every float type: an element the kernels do not write stays NaN); 2: absent, NULL; 3: an input
 *     the calls may write to (the decoding step's ring), its bytes following as an input's, returned as an
 *     output's);
 *   then the calls, run in order on those buffers (a later call reads what an earlier one wrote: the backward
 *     reads the forward's stat): a count, and for each: the function's name (its length in bytes, then the
 *     name padded to a whole word), its settings block (a count of words, then the words: fused_cpu.c's
 *     pi_call, or decode_step.c's pi_step_args with each pointer field holding a buffer number + 1, 0 for
 *     NULL), the numbers of the settings' pointer fields (a count, then the field numbers), and the fused
 *     kernels' buffer list (a count, then buffer number + 1 each, 0 for an empty pi_buffer {NULL, 0}).
 * OUT: magic PIXH_OUT, the calls' count and each one's return code, then the count of output buffers (roles
 * 1 and 3) and for each: its number, its bytes, the bytes themselves padded to a whole word.
 *
 * Exit status 0 when every step of reading, calling and writing went through (whatever the kernels
 * returned: their codes are in OUT), 2 on a malformed IN or an I/O error (said on stderr). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PIXH_IN 0x4e49485849500001LL
#define PIXH_OUT 0x54554f4849500001LL

/* fused_cpu.c's pi_buffer; its pi_call is passed as the words of the settings block (17 8-byte fields). */
typedef struct {
  void *data;
  int64_t numel;
} pi_buffer;

typedef int (*fused_fn)(const void *call, const pi_buffer *buf, int64_t n_buf);
typedef int (*step_fn)(const void *packed);

int pi_fused_forward_f32(const void *, const pi_buffer *, int64_t);
int pi_fused_forward_f64(const void *, const pi_buffer *, int64_t);
int pi_fused_forward_bf16(const void *, const pi_buffer *, int64_t);
int pi_fused_forward_f16(const void *, const pi_buffer *, int64_t);
int pi_fused_backward_f32(const void *, const pi_buffer *, int64_t);
int pi_fused_backward_f64(const void *, const pi_buffer *, int64_t);
int pi_fused_backward_bf16(const void *, const pi_buffer *, int64_t);
int pi_fused_backward_f16(const void *, const pi_buffer *, int64_t);
int pi_decode_step_packed_f32(const void *);
int pi_decode_step_packed_f64(const void *);
int64_t pi_step_args_size(void);

static const struct {
  const char *name;
  fused_fn fused;
  step_fn step;
} FUNCTIONS[] = {
    {"pi_fused_forward_f32", pi_fused_forward_f32, NULL},   {"pi_fused_forward_f64", pi_fused_forward_f64, NULL},
    {"pi_fused_forward_bf16", pi_fused_forward_bf16, NULL}, {"pi_fused_forward_f16", pi_fused_forward_f16, NULL},
    {"pi_fused_backward_f32", pi_fused_backward_f32, NULL}, {"pi_fused_backward_f64", pi_fused_backward_f64, NULL},
    {"pi_fused_backward_bf16", pi_fused_backward_bf16, NULL},
    {"pi_fused_backward_f16", pi_fused_backward_f16, NULL},
    {"pi_decode_step_packed_f32", NULL, pi_decode_step_packed_f32},
    {"pi_decode_step_packed_f64", NULL, pi_decode_step_packed_f64},
};

#define PI_CALL_WORDS 17 /* fused_cpu.c's pi_call: 12 int64 and 5 double fields */

static FILE *in;

static void fail(const char *what) {
  fprintf(stderr, "cross_harness: %s\n", what);
  exit(2);
}

static int64_t word(void) {
  int64_t w;
  if (fread(&w, sizeof w, 1, in) != 1) fail("IN ends too early");
  return w;
}

static int64_t count(int64_t most) {
  const int64_t n = word();
  if (n < 0 || n > most) fail("a count out of range in IN");
  return n;
}

static int64_t padded(int64_t bytes) { return (bytes + 7) / 8 * 8; }

static void put(FILE *out, const void *p, size_t bytes) {
  if (bytes && fwrite(p, 1, bytes, out) != bytes) fail("cannot write OUT");
}

static void put_word(FILE *out, int64_t w) { put(out, &w, sizeof w); }

int main(int argc, char **argv) {
  if (argc != 3) fail("usage: cross_harness IN OUT");
  if (!(in = fopen(argv[1], "rb"))) fail("cannot open IN");
  if (word() != PIXH_IN) fail("IN is not a harness input (magic)");

  const int64_t n_buf = count(1 << 16);
  void **data = calloc((size_t)n_buf + 1, sizeof *data);
  int64_t *bytes = calloc((size_t)n_buf + 1, sizeof *bytes), *size = calloc((size_t)n_buf + 1, sizeof *size);
  int64_t *role = calloc((size_t)n_buf + 1, sizeof *role);
  if (!data || !bytes || !size || !role) fail("out of memory");
  for (int64_t i = 0; i < n_buf; i++) {
    bytes[i] = count(INT64_C(1) << 32);
    size[i] = count(8);
    role[i] = count(3);
    if (size[i] < 1 || bytes[i] % size[i]) fail("a buffer's bytes are not whole elements");
    if (role[i] == 2) continue;
    /* 64-byte aligned, as torch allocates; at least one line, so that an empty buffer has a pointer */
    data[i] = aligned_alloc(64, (size_t)padded(bytes[i] > 64 ? bytes[i] : 64) / 64 * 64 + 64);
    if (!data[i]) fail("out of memory");
    if (role[i] == 0 || role[i] == 3) {
      if (fread(data[i], 1, (size_t)padded(bytes[i]), in) != (size_t)padded(bytes[i])) fail("IN ends in a buffer");
    } else {
      memset(data[i], 0xff, (size_t)bytes[i]);
    }
  }

  const int64_t n_calls = count(1024);
  int64_t *codes = calloc((size_t)n_calls + 1, sizeof *codes);
  if (!codes) fail("out of memory");
  for (int64_t c = 0; c < n_calls; c++) {
    char name[64] = {0};
    const int64_t len = count(sizeof name - 8);
    if (fread(name, 1, (size_t)padded(len), in) != (size_t)padded(len)) fail("IN ends in a name");
    name[len] = 0;
    int f = -1;
    for (int j = 0; j < (int)(sizeof FUNCTIONS / sizeof FUNCTIONS[0]); j++)
      if (!strcmp(name, FUNCTIONS[j].name)) f = j;
    if (f < 0) fail("unknown function");

    const int64_t n_fields = count(64);
    int64_t fields[64];
    for (int64_t j = 0; j < n_fields; j++) fields[j] = word();
    const int64_t n_ptr = count(n_fields);
    for (int64_t j = 0; j < n_ptr; j++) {
      const int64_t at = count(n_fields - 1), b = fields[at];
      if (b < 0 || b > n_buf) fail("a pointer field names no buffer");
      const void *p = b ? data[b - 1] : NULL;
      memcpy(&fields[at], &p, sizeof p);
    }
    const int64_t n_list = count(64);
    pi_buffer list[64];
    for (int64_t j = 0; j < n_list; j++) {
      const int64_t b = count(n_buf);
      list[j].data = b ? data[b - 1] : NULL;
      list[j].numel = b ? bytes[b - 1] / size[b - 1] : 0;
    }

    if (FUNCTIONS[f].fused) {
      if (n_fields != PI_CALL_WORDS) fail("a fused call takes the 17 words of pi_call");
      codes[c] = FUNCTIONS[f].fused(fields, list, n_list);
    } else {
      if (n_fields * 8 != pi_step_args_size()) fail("the step's settings block is not pi_step_args' size");
      codes[c] = FUNCTIONS[f].step(fields);
    }
  }
  if (fgetc(in) != EOF) fail("IN goes on past its last call");
  fclose(in);

  FILE *out = fopen(argv[2], "wb");
  if (!out) fail("cannot open OUT");
  put_word(out, PIXH_OUT);
  put_word(out, n_calls);
  for (int64_t c = 0; c < n_calls; c++) put_word(out, codes[c]);
  int64_t n_out = 0;
  for (int64_t i = 0; i < n_buf; i++) n_out += role[i] == 1 || role[i] == 3;
  put_word(out, n_out);
  static const char zeros[8] = {0};
  for (int64_t i = 0; i < n_buf; i++) {
    if (role[i] != 1 && role[i] != 3) continue;
    put_word(out, i);
    put_word(out, bytes[i]);
    put(out, data[i], (size_t)bytes[i]);
    put(out, zeros, (size_t)(padded(bytes[i]) - bytes[i]));
  }
  if (fclose(out)) fail("cannot write OUT");
  return 0;
}
