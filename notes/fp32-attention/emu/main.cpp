#include "shim.h"
#include "f32_section.inc"

static std::vector<float> readf(const char* dir, const char* name, size_t n) {
    std::vector<float> v(n);
    char path[512];
    std::snprintf(path, sizeof path, "%s/%s.bin", dir, name);
    FILE* f = std::fopen(path, "rb");
    if (!f || std::fread(v.data(), 4, n, f) != n) { std::fprintf(stderr, "cannot read %s\n", path); std::exit(2); }
    std::fclose(f);
    return v;
}
static void writef(const char* dir, const char* name, const std::vector<float>& v) {
    char path[512];
    std::snprintf(path, sizeof path, "%s/%s.bin", dir, name);
    FILE* f = std::fopen(path, "wb");
    std::fwrite(v.data(), 4, v.size(), f);
    std::fclose(f);
}

struct L { long long sb, sh, st; };

template <int D>
void run(const char* dir, int B, int H, int T, int layout, unsigned seed) {
    using S = F32Shape<D>;
    const size_t n = (size_t)B * H * T * D, nr = (size_t)B * H * T;
    auto q = readf(dir, "q", n), k = readf(dir, "k", n), v = readf(dir, "v", n), g = readf(dir, "g", n);
    // layout 0: every operand [B, H, T, D]; 1: q, k, v and dq, dk, dv views of [B, T, 3, H, D],
    // out and grad of [B, T, H, D] (an extra 4-float offset in front of every buffer).
    const int off = layout ? 4 : 0;
    L in, ol, gl;
    size_t in_size, o_size;
    if (layout == 0) { in = gl = ol = L{(long long)H * T * D, (long long)T * D, D}; in_size = o_size = n; }
    else {
        in = gl = L{(long long)T * 3 * H * D, D, 3LL * H * D};
        ol = L{(long long)T * H * D, D, (long long)H * D};
        in_size = 3 * n; o_size = n;
    }
    const long long comp = layout ? (long long)H * D : 0;  // q, k, v offsets within the packed row
    std::vector<float> qkv(in_size + off + 64, NAN), og(o_size + off + 64, NAN), gg(o_size + off + 64, NAN);
    std::vector<float> dqkv(in_size + off + 64, NAN);
    float* qp = qkv.data() + off; float* kp = qp + comp; float* vp = qp + 2 * comp;
    std::vector<float> kbuf, vbuf;
    if (layout == 0) { kbuf.assign(n + off + 64, NAN); vbuf.assign(n + off + 64, NAN); kp = kbuf.data() + off; vp = vbuf.data() + off; }
    auto at = [&](const L& l, int b, int h, int t) { return b * l.sb + h * l.sh + t * l.st; };
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < T; ++t) for (int d = 0; d < D; ++d) {
        const size_t c = (((size_t)b * H + h) * T + t) * D + d;
        qp[at(in, b, h, t) + d] = q[c]; kp[at(in, b, h, t) + d] = k[c]; vp[at(in, b, h, t) + d] = v[c];
        gg[off + at(ol, b, h, t) + d] = g[c];
    }
    float* outp = og.data() + off;
    std::vector<float> lse(nr + 16, NAN), delta(nr + 16, NAN);
    const float scale = 1.0f / std::sqrt((float)D);
    const int bq = 2 * S::WM;
    g_mode = 0;
    const int mode = std::getenv("EMU_MODE") ? std::atoi(std::getenv("EMU_MODE")) : 0;
    g_mode = mode;
    launch(dim3{(unsigned)((T + bq - 1) / bq), (unsigned)(B * H), 1}, kF32Threads, [&] {
        attention_fwd<float, D>(qp, kp, vp, outp, lse.data(), T, H, scale, in.sb, in.sh, in.st, ol.sb, ol.sh, ol.st);
    }, seed);
    // delta = rowsum(g * out) (the attention_bwd_delta kernel, in float)
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < T; ++t) {
        float s = 0; for (int d = 0; d < D; ++d) s += gg[off + at(ol, b, h, t) + d] * outp[at(ol, b, h, t) + d];
        delta[((size_t)b * H + h) * T + t] = s;
    }
    float* dqp = dqkv.data() + off; float* dkp = dqp + comp; float* dvp = dqp + 2 * comp;
    std::vector<float> dkbuf, dvbuf;
    if (layout == 0) { dkbuf.assign(n + off + 64, NAN); dvbuf.assign(n + off + 64, NAN); dkp = dkbuf.data() + off; dvp = dvbuf.data() + off; }
    const float* gp = gg.data() + off;
    launch(dim3{(unsigned)((T + S::WM - 1) / S::WM), (unsigned)(B * H), 1}, kF32Threads, [&] {
        attention_bwd_dkdv<float, D>(qp, kp, vp, gp, lse.data(), delta.data(), dkp, dvp, T, H, scale,
                                     in.sb, in.sh, in.st, ol.sb, ol.sh, ol.st, gl.sb, gl.sh, gl.st);
    }, seed + 1);
    launch(dim3{(unsigned)((T + S::WM - 1) / S::WM), (unsigned)(B * H), 1}, kF32Threads, [&] {
        attention_bwd_dq<float, D>(qp, kp, vp, gp, lse.data(), delta.data(), dqp, T, H, scale,
                                   in.sb, in.sh, in.st, ol.sb, ol.sh, ol.st, gl.sb, gl.sh, gl.st);
    }, seed + 2);
    std::vector<float> o1(n), dq1(n), dk1(n), dv1(n);
    for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < T; ++t) for (int d = 0; d < D; ++d) {
        const size_t c = (((size_t)b * H + h) * T + t) * D + d;
        o1[c] = outp[at(ol, b, h, t) + d];
        dq1[c] = dqp[at(gl, b, h, t) + d]; dk1[c] = dkp[at(gl, b, h, t) + d]; dv1[c] = dvp[at(gl, b, h, t) + d];
    }
    lse.resize(nr);
    writef(dir, "out", o1); writef(dir, "lse", lse); writef(dir, "dq", dq1); writef(dir, "dk", dk1); writef(dir, "dv", dv1);
    // Writes outside the outputs: every element of the padded buffers that is not an output must stay NaN.
    long stray = 0;
    auto check = [&](const std::vector<float>& buf, const float* base0, std::vector<const float*> views, const L& l) {
        std::vector<char> mark(buf.size(), 0);
        for (auto p : views) for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < T; ++t) for (int d = 0; d < D; ++d)
            mark[(p - buf.data()) + at(l, b, h, t) + d] = 1;
        for (size_t i = 0; i < buf.size(); ++i) if (!mark[i] && !std::isnan(buf[i])) stray++;
        (void)base0;
    };
    check(og, outp, {outp}, ol);
    if (layout) check(dqkv, dqp, {dqp, dkp, dvp}, gl);
    else { check(dqkv, dqp, {dqp}, gl); check(dkbuf, dkp, {dkp}, gl); check(dvbuf, dvp, {dvp}, gl); }
    for (size_t i = nr; i < nr + 16; ++i) {}
    std::printf("stray_writes %ld align_errors %ld\n", stray, g_align_errors);
}

int main(int argc, char** argv) {
    if (argc < 7) { std::fprintf(stderr, "usage: dir B H T D layout [seed]\n"); return 2; }
    const char* dir = argv[1];
    const int B = std::atoi(argv[2]), H = std::atoi(argv[3]), T = std::atoi(argv[4]), D = std::atoi(argv[5]);
    const int layout = std::atoi(argv[6]);
    const unsigned seed = argc > 7 ? std::atoi(argv[7]) : 1;
    if (D == 32) run<32>(dir, B, H, T, layout, seed);
    else if (D == 64) run<64>(dir, B, H, T, layout, seed);
    else if (D == 128) run<128>(dir, B, H, T, layout, seed);
    else return 3;
    return 0;
}
