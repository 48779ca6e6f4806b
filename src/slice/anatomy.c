/* Model anatomy: bytes of a GGUF file by class, by layer, by type, and its
 * expert slabs, computed from the tensor infos of the header.
 *
 * Invariants: only kv_gguf_tensor fields that come from the header (name,
 * dims, type, nbytes) are read, never tensor data, so measuring a sparse
 * skeleton or a 70 GB model costs the header parse and nothing more. Block
 * numbers come from names ("blk.N.") and are bounded by KV_ANAT_MAX_LAYERS
 * before they index anything. Sums of tensor sizes cannot overflow: the
 * reader checked every tensor lies inside the file, so their sum is below
 * the file size.
 *
 * A tensor the file's architecture table (arch.h) names takes its class
 * from the table's role; any other name (or a file of an architecture
 * without a table) follows the name rules of anatomy.h.
 *
 * Two passes over the tensors: the first finds which blocks are recurrent
 * (hold ssm_* tensors, which decides what attn_qkv/attn_gate are), the
 * second classifies and sums. */
#include "kvasir/anatomy.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/arch.h"
#include "kvasir/quant.h"

static const char *const class_ids[KV_ANAT_CLASS_COUNT] = {
    [KV_ANAT_ROUTED_EXPERTS] = "routed_experts", [KV_ANAT_SHARED_EXPERTS] = "shared_experts",
    [KV_ANAT_ATTENTION] = "attention",           [KV_ANAT_LINEAR_ATTENTION] = "linear_attention",
    [KV_ANAT_ROUTER] = "router",                 [KV_ANAT_DENSE_FFN] = "dense_ffn",
    [KV_ANAT_NORMS] = "norms",                   [KV_ANAT_EMBEDDINGS] = "embeddings",
    [KV_ANAT_LM_HEAD] = "lm_head",               [KV_ANAT_MTP] = "mtp",
    [KV_ANAT_OTHER] = "other",
};
static const char *const class_labels[KV_ANAT_CLASS_COUNT] = {
    [KV_ANAT_ROUTED_EXPERTS] = "routed experts", [KV_ANAT_SHARED_EXPERTS] = "shared experts",
    [KV_ANAT_ATTENTION] = "attention",           [KV_ANAT_LINEAR_ATTENTION] = "linear attention",
    [KV_ANAT_ROUTER] = "router",                 [KV_ANAT_DENSE_FFN] = "dense FFN",
    [KV_ANAT_NORMS] = "norms",                   [KV_ANAT_EMBEDDINGS] = "embeddings",
    [KV_ANAT_LM_HEAD] = "LM head",               [KV_ANAT_MTP] = "MTP (nextn)",
    [KV_ANAT_OTHER] = "other",
};
/* short column headers of the per-layer table */
static const char *const class_cols[KV_ANAT_CLASS_COUNT] = {
    [KV_ANAT_ROUTED_EXPERTS] = "routed", [KV_ANAT_SHARED_EXPERTS] = "shared",
    [KV_ANAT_ATTENTION] = "attn",        [KV_ANAT_LINEAR_ATTENTION] = "linear",
    [KV_ANAT_ROUTER] = "router",         [KV_ANAT_DENSE_FFN] = "ffn",
    [KV_ANAT_NORMS] = "norms",           [KV_ANAT_EMBEDDINGS] = "embd",
    [KV_ANAT_LM_HEAD] = "head",          [KV_ANAT_MTP] = "mtp",
    [KV_ANAT_OTHER] = "other",
};

const char *kv_anat_class_id(int c) {
    return c >= 0 && c < KV_ANAT_CLASS_COUNT ? class_ids[c] : "?";
}
const char *kv_anat_class_label(int c) {
    return c >= 0 && c < KV_ANAT_CLASS_COUNT ? class_labels[c] : "?";
}

/* ---- names ------------------------------------------------------------ */

static bool starts(const char *s, size_t len, const char *pre) {
    size_t n = strlen(pre);
    return len >= n && memcmp(s, pre, n) == 0;
}

static bool contains(const char *s, size_t len, const char *sub) {
    size_t n = strlen(sub);
    if (n > len) return false;
    for (size_t i = 0; i + n <= len; i++)
        if (memcmp(s + i, sub, n) == 0) return true;
    return false;
}

/* Splits "blk.N.rest": returns N (or -1 if the name is not of that form, or
 * N is beyond KV_ANAT_MAX_LAYERS: then -2) and points *rest past "blk.N.". */
static int32_t split_block(const char *s, size_t len, const char **rest, size_t *rest_len) {
    *rest = s;
    *rest_len = len;
    if (!starts(s, len, "blk.")) return -1;
    size_t i = 4;
    uint32_t n = 0;
    if (i >= len || s[i] < '0' || s[i] > '9') return -1;
    while (i < len && s[i] >= '0' && s[i] <= '9') {
        n = n * 10 + (uint32_t)(s[i] - '0');
        if (n >= KV_ANAT_MAX_LAYERS) return -2;
        i++;
    }
    if (i >= len || s[i] != '.') return -1;
    *rest = s + i + 1;
    *rest_len = len - i - 1;
    return (int32_t)n;
}

int kv_anat_classify(const char *name, size_t len, bool recurrent, int32_t *layer) {
    const char *r;
    size_t rl;
    int32_t blk = split_block(name, len, &r, &rl);
    if (layer) *layer = blk < 0 ? -1 : blk;
    if (starts(r, rl, "nextn.") || contains(r, rl, ".nextn.")) return KV_ANAT_MTP;
    if (starts(r, rl, "ssm_") || starts(r, rl, "time_mix_") || starts(r, rl, "shortconv"))
        return KV_ANAT_LINEAR_ATTENTION;
    if (recurrent && (starts(r, rl, "attn_qkv.") || starts(r, rl, "attn_gate.")))
        return KV_ANAT_LINEAR_ATTENTION;
    if (contains(r, rl, "_exps")) return KV_ANAT_ROUTED_EXPERTS;
    if (contains(r, rl, "_shexp") || contains(r, rl, "_chexp")) return KV_ANAT_SHARED_EXPERTS;
    if (starts(r, rl, "ffn_gate_inp") || starts(r, rl, "exp_probs_b")) return KV_ANAT_ROUTER;
    if (contains(r, rl, "norm")) return KV_ANAT_NORMS;
    if (blk >= 0) {
        if (starts(r, rl, "attn_")) return KV_ANAT_ATTENTION;
        if (starts(r, rl, "ffn_")) return KV_ANAT_DENSE_FFN;
        return KV_ANAT_OTHER;
    }
    if (starts(r, rl, "token_embd.") || starts(r, rl, "per_layer_token_embd.") ||
        starts(r, rl, "position_embd.") || starts(r, rl, "token_types."))
        return KV_ANAT_EMBEDDINGS;
    if (starts(r, rl, "output.")) return KV_ANAT_LM_HEAD;
    return KV_ANAT_OTHER;
}

/* Role of an expert tensor in a type label: "gate" for ffn_gate_exps.weight,
 * "down.bias" for ffn_down_exps.bias. */
static void expert_role(const char *r, size_t rl, char *out, size_t cap) {
    const char *p = r;
    size_t n = rl;
    if (starts(p, n, "ffn_")) {
        p += 4;
        n -= 4;
    }
    size_t stem = 0;
    while (stem + 5 <= n && memcmp(p + stem, "_exps", 5) != 0) stem++;
    if (stem + 5 > n) stem = n;
    const char *suf = p + stem + 5;
    size_t suf_len = stem + 5 <= n ? n - stem - 5 : 0;
    if (suf_len && *suf == '.') {
        suf++;
        suf_len--;
    }
    if (suf_len == 6 && memcmp(suf, "weight", 6) == 0) suf_len = 0;
    snprintf(out, cap, "%.*s%s%.*s", (int)stem, p, suf_len ? "." : "", (int)suf_len, suf);
}

static int role_rank(const char *role) {
    static const char *const order[] = {"gate_up", "gate", "up", "down"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(role, order[i])) return i;
    return 4;
}

/* Class of a tensor the architecture's table names (from its role), or -1
 * for a name the table does not know (or no table): then the name rules
 * decide. */
static int table_class(const kv_arch_table *at, const char *name, size_t len) {
    static const int by_role[KV_ROLE_COUNT] = {
        [KV_ROLE_EMBD] = KV_ANAT_EMBEDDINGS,   [KV_ROLE_LM_HEAD] = KV_ANAT_LM_HEAD,
        [KV_ROLE_NORM] = KV_ANAT_NORMS,        [KV_ROLE_ATTN] = KV_ANAT_ATTENTION,
        [KV_ROLE_LINEAR] = KV_ANAT_LINEAR_ATTENTION, [KV_ROLE_ROUTER] = KV_ANAT_ROUTER,
        [KV_ROLE_EXPERT] = KV_ANAT_ROUTED_EXPERTS,   [KV_ROLE_SHEXP] = KV_ANAT_SHARED_EXPERTS,
        [KV_ROLE_MTP] = KV_ANAT_MTP,           [KV_ROLE_FFN] = KV_ANAT_DENSE_FFN,
    };
    int32_t il;
    const kv_tensor_desc *t = at ? kv_arch_match(at, name, len, &il) : NULL;
    return t && (unsigned)t->role < KV_ROLE_COUNT ? by_role[t->role] : -1;
}

/* ---- measuring -------------------------------------------------------- */

#define MAX_ROLES 8 /* expert tensors per layer that get a place in the label */

typedef struct layer_acc {
    bool present, recurrent;
    kv_anat_layer l;
    int n_roles;
    struct {
        char role[24];
        uint32_t type;
    } roles[MAX_ROLES];
} layer_acc;

static int cmp_role(const void *a, const void *b) {
    const char *ra = a, *rb = b; /* role is the first member */
    int d = role_rank(ra) - role_rank(rb);
    return d ? d : strcmp(ra, rb);
}

static int cmp_type(const void *a, const void *b) {
    const kv_anat_type *x = a, *y = b;
    if (x->bytes != y->bytes) return x->bytes < y->bytes ? 1 : -1;
    return x->type < y->type ? -1 : x->type > y->type;
}

static int cmp_combo(const void *a, const void *b) {
    const kv_anat_combo *x = a, *y = b;
    if (x->n_slabs != y->n_slabs) return x->n_slabs < y->n_slabs ? 1 : -1;
    if (x->expert_bytes != y->expert_bytes) return x->expert_bytes < y->expert_bytes ? -1 : 1;
    return strcmp(x->types, y->types);
}

static void copy_str(char *dst, size_t cap, kv_str s) {
    size_t n = s.len < cap - 1 ? s.len : cap - 1;
    memcpy(dst, s.ptr, n);
    dst[n] = 0;
    for (size_t i = 0; i < n; i++) /* keep the report one line per field */
        if ((unsigned char)dst[i] < 0x20) dst[i] = '?';
}

void kv_anatomy_free(kv_anatomy *a) {
    if (!a) return;
    free(a->layers);
    free(a->combos);
    free(a->types);
    free(a->parts);
    free(a);
}

int kv_anatomy_from_gguf(kv_anatomy **out, const kv_gguf *g, kv_diag *d) {
    *out = NULL;
    kv_anatomy *a = calloc(1, sizeof *a);
    layer_acc *acc = NULL;
    if (!a) return kv_fail(d, KV_ENOMEM, "out of memory");
    size_t nt = kv_gguf_n_tensors(g);
    a->n_parts = kv_gguf_n_parts(g);
    if (a->n_parts > 1 && !(a->parts = calloc(a->n_parts, sizeof *a->parts))) goto oom;
    for (size_t p = 0; p < a->n_parts; p++) {
        const kv_gguf *pg = kv_gguf_part(g, p);
        a->file_size += kv_gguf_file_size(pg);
        a->data_offset += kv_gguf_data_offset(pg);
        if (a->parts) a->parts[p].file_size = kv_gguf_file_size(pg);
    }
    a->n_tensors = nt;
    /* a type no backend computes: kvasir run and the gateway refuse the file
     * at load, naming the first such tensor the model needs */
    for (size_t i = 0; i < nt; i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        if (a->parts) {
            a->parts[t->part].n_tensors++;
            a->parts[t->part].tensor_bytes += t->nbytes;
        }
        const kv_type_info *ti = kv_type_get(t->type);
        if (ti && ti->compute) continue;
        if (!a->n_uncomputable++) {
            copy_str(a->uncomputable, sizeof a->uncomputable, t->name);
            a->uncomputable_type = t->type;
        }
    }
    kv_str s;
    if (kv_gguf_get_str(g, "general.architecture", &s, NULL) == 0) copy_str(a->arch, sizeof a->arch, s);
    if (kv_gguf_get_str(g, "general.name", &s, NULL) == 0) copy_str(a->name, sizeof a->name, s);
    if (a->arch[0]) {
        char key[128];
        snprintf(key, sizeof key, "%s.block_count", a->arch);
        if (kv_gguf_get_u32(g, key, &a->block_count, NULL)) a->block_count = 0;
        snprintf(key, sizeof key, "%s.nextn_predict_layers", a->arch);
        if (kv_gguf_get_u32(g, key, &a->nextn_layers, NULL)) a->nextn_layers = 0;
    }

    const kv_arch_table *at = kv_arch_find(a->arch);

    /* pass 1: which blocks exist, which are recurrent */
    uint32_t max_blk = 0;
    bool any_blk = false;
    for (size_t i = 0; i < nt; i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        const char *r;
        size_t rl;
        int32_t b = split_block(t->name.ptr, t->name.len, &r, &rl);
        if (b == -2) {
            kv_anatomy_free(a);
            return kv_fail(d, KV_EFORMAT, "tensor '%.*s': block number beyond %u", (int)t->name.len,
                           t->name.ptr, KV_ANAT_MAX_LAYERS - 1);
        }
        if (b >= 0) {
            any_blk = true;
            if ((uint32_t)b > max_blk) max_blk = (uint32_t)b;
        }
    }
    size_t n_slots = any_blk ? (size_t)max_blk + 1 : 0;
    if (n_slots && !(acc = calloc(n_slots, sizeof *acc))) goto oom;
    for (size_t i = 0; i < nt; i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        const char *r;
        size_t rl;
        int32_t b = split_block(t->name.ptr, t->name.len, &r, &rl);
        if (b < 0) continue;
        acc[b].present = true;
        if (starts(r, rl, "ssm_")) acc[b].recurrent = true;
    }

    /* pass 2: classify and sum */
    kv_anat_type *types = NULL;
    size_t n_types = 0;
    for (size_t i = 0; i < nt; i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        const char *r;
        size_t rl;
        int32_t b = split_block(t->name.ptr, t->name.len, &r, &rl);
        int c = table_class(at, t->name.ptr, t->name.len);
        if (c < 0) c = kv_anat_classify(t->name.ptr, t->name.len, b >= 0 && acc[b].recurrent, NULL);
        a->class_bytes[c] += t->nbytes;
        a->class_tensors[c]++;
        a->tensor_bytes += t->nbytes;

        size_t k = 0;
        while (k < n_types && types[k].type != t->type) k++;
        if (k == n_types) {
            kv_anat_type *p = realloc(types, (n_types + 1) * sizeof *p);
            if (!p) {
                free(types);
                goto oom;
            }
            types = p;
            types[n_types++] = (kv_anat_type){.type = t->type};
        }
        types[k].n_tensors++;
        types[k].bytes += t->nbytes;

        if (b < 0) continue;
        layer_acc *la = &acc[b];
        kv_anat_layer *l = &la->l;
        l->n_tensors++;
        l->bytes[c] += t->nbytes;
        l->total += t->nbytes;
        switch (c) {
        case KV_ANAT_ATTENTION: l->kind |= KV_ANAT_LAYER_ATTN; break;
        case KV_ANAT_LINEAR_ATTENTION: l->kind |= KV_ANAT_LAYER_LINEAR; break;
        case KV_ANAT_DENSE_FFN: l->kind |= KV_ANAT_LAYER_DENSE; break;
        case KV_ANAT_MTP: l->kind |= KV_ANAT_LAYER_MTP; break;
        default: break;
        }
        if (c != KV_ANAT_ROUTED_EXPERTS) continue;
        l->kind |= KV_ANAT_LAYER_MOE;
        uint64_t outer = t->ne[t->n_dims ? t->n_dims - 1 : 0];
        if (outer == 0) continue; /* an empty tensor holds no expert */
        if (outer > UINT32_MAX) outer = UINT32_MAX;
        if (l->n_expert == 0)
            l->n_expert = (uint32_t)outer;
        else if (l->n_expert != outer)
            l->expert_mismatch = true;
        l->expert_bytes += t->nbytes / outer;
        if (la->n_roles < MAX_ROLES) {
            expert_role(r, rl, la->roles[la->n_roles].role, sizeof la->roles[0].role);
            la->roles[la->n_roles++].type = t->type;
        }
    }
    qsort(types, n_types, sizeof *types, cmp_type);
    a->types = types;
    a->n_types = n_types;

    /* layers: compact, label expert types, slab statistics */
    size_t n_present = 0;
    for (size_t b = 0; b < n_slots; b++) n_present += acc[b].present;
    if (n_present && !(a->layers = calloc(n_present, sizeof *a->layers))) goto oom;
    long double slab_sum = 0;
    for (size_t b = 0; b < n_slots; b++) {
        layer_acc *la = &acc[b];
        if (!la->present) continue;
        kv_anat_layer *l = &la->l;
        l->index = (uint32_t)b;
        if (a->nextn_layers && a->block_count >= a->nextn_layers &&
            b >= a->block_count - a->nextn_layers && b < a->block_count)
            l->kind |= KV_ANAT_LAYER_MTP;
        qsort(la->roles, (size_t)la->n_roles, sizeof la->roles[0], cmp_role);
        size_t pos = 0;
        for (int k = 0; k < la->n_roles && pos < sizeof l->expert_types; k++) {
            const kv_type_info *ti = kv_type_get_ref(la->roles[k].type);
            int w = snprintf(l->expert_types + pos, sizeof l->expert_types - pos, "%s%s %s",
                             k ? ", " : "", la->roles[k].role, ti && ti->name ? ti->name : "?");
            if (w < 0) break;
            pos += (size_t)w;
        }
        if (l->n_expert) {
            a->n_moe_layers++;
            a->n_slabs += l->n_expert;
            slab_sum += (long double)l->expert_bytes * l->n_expert;
            if (a->n_moe_layers == 1 || l->expert_bytes < a->expert_min) a->expert_min = l->expert_bytes;
            if (l->expert_bytes > a->expert_max) a->expert_max = l->expert_bytes;
            size_t k = 0;
            while (k < a->n_combos && !(a->combos[k].expert_bytes == l->expert_bytes &&
                                        !strcmp(a->combos[k].types, l->expert_types)))
                k++;
            if (k == a->n_combos) {
                kv_anat_combo *p = realloc(a->combos, (a->n_combos + 1) * sizeof *p);
                if (!p) goto oom;
                a->combos = p;
                memset(&p[k], 0, sizeof p[k]);
                memcpy(p[k].types, l->expert_types, sizeof p[k].types);
                p[k].expert_bytes = l->expert_bytes;
                a->n_combos++;
            }
            a->combos[k].n_layers++;
            a->combos[k].n_slabs += l->n_expert;
        }
        a->layers[a->n_layers++] = *l;
    }
    if (a->n_slabs) a->expert_mean = (double)(slab_sum / (long double)a->n_slabs);
    qsort(a->combos, a->n_combos, sizeof *a->combos, cmp_combo);
    free(acc);
    *out = a;
    return 0;
oom:
    free(acc);
    kv_anatomy_free(a);
    return kv_fail(d, KV_ENOMEM, "out of memory measuring %zu tensors", nt);
}

int kv_anatomy_open(kv_anatomy **out, const char *path, kv_diag *d) {
    *out = NULL;
    kv_gguf *g = NULL;
    int rc = kv_gguf_open(&g, path, d);
    if (rc) return rc;
    rc = kv_anatomy_from_gguf(out, g, d);
    kv_gguf_close(g);
    return rc;
}

/* ---- JSON ------------------------------------------------------------- */

static const char *kind_str(uint32_t k, char *buf, size_t cap) {
    buf[0] = 0;
    const char *attn = (k & KV_ANAT_LAYER_MTP) ? "mtp"
                       : (k & KV_ANAT_LAYER_LINEAR) ? "linear"
                       : (k & KV_ANAT_LAYER_ATTN) ? "attn"
                                                  : "";
    const char *ffn = (k & KV_ANAT_LAYER_MOE) ? "moe" : (k & KV_ANAT_LAYER_DENSE) ? "dense" : "";
    snprintf(buf, cap, "%s%s%s", attn, *attn && *ffn ? "+" : "", ffn);
    if (!buf[0]) snprintf(buf, cap, "-");
    return buf;
}

static double share(uint64_t part, uint64_t whole) { return whole ? (double)part / (double)whole : 0.0; }

static json_t *jint(uint64_t v) { return json_integer((json_int_t)v); }

char *kv_anatomy_to_json(const kv_anatomy *a) {
    json_t *root = json_object(), *classes = json_array(), *types = json_array(), *layers = json_array(),
           *experts = json_object(), *combos = json_array();
    char kb[32];
    if (!root || !classes || !types || !layers || !experts || !combos) goto fail;
    json_object_set_new(root, "architecture", json_string(a->arch));
    json_object_set_new(root, "name", json_string(a->name));
    json_object_set_new(root, "file_bytes", jint(a->file_size));
    json_object_set_new(root, "header_bytes", jint(a->data_offset));
    json_object_set_new(root, "tensor_bytes", jint(a->tensor_bytes));
    json_object_set_new(root, "n_tensors", jint(a->n_tensors));
    json_object_set_new(root, "block_count", jint(a->block_count));
    json_object_set_new(root, "nextn_predict_layers", jint(a->nextn_layers));
    if (a->parts) {
        json_t *ps = json_array();
        if (!ps) goto fail;
        for (size_t p = 0; p < a->n_parts; p++) {
            json_t *o = json_object();
            if (!o) {
                json_decref(ps);
                goto fail;
            }
            json_object_set_new(o, "file_bytes", jint(a->parts[p].file_size));
            json_object_set_new(o, "tensors", jint(a->parts[p].n_tensors));
            json_object_set_new(o, "tensor_bytes", jint(a->parts[p].tensor_bytes));
            json_array_append_new(ps, o);
        }
        json_object_set_new(root, "parts", ps);
    }
    if (a->n_uncomputable) {
        const kv_type_info *ti = kv_type_get_ref(a->uncomputable_type);
        json_t *o = json_object();
        if (!o) goto fail;
        json_object_set_new(o, "tensors", jint(a->n_uncomputable));
        json_object_set_new(o, "first", json_string(a->uncomputable));
        json_object_set_new(o, "type", json_string(ti && ti->name ? ti->name : "?"));
        json_object_set_new(o, "type_id", jint(a->uncomputable_type));
        json_object_set_new(root, "uncomputable", o);
    }
    for (int c = 0; c < KV_ANAT_CLASS_COUNT; c++) {
        json_t *o = json_object();
        if (!o) goto fail;
        json_object_set_new(o, "class", json_string(class_ids[c]));
        json_object_set_new(o, "bytes", jint(a->class_bytes[c]));
        json_object_set_new(o, "tensors", jint(a->class_tensors[c]));
        json_object_set_new(o, "share", json_real(share(a->class_bytes[c], a->tensor_bytes)));
        json_array_append_new(classes, o);
    }
    json_object_set_new(root, "classes", classes);
    classes = NULL;

    json_object_set_new(experts, "moe_layers", jint(a->n_moe_layers));
    json_object_set_new(experts, "slabs", jint(a->n_slabs));
    json_object_set_new(experts, "bytes_min", jint(a->expert_min));
    json_object_set_new(experts, "bytes_max", jint(a->expert_max));
    json_object_set_new(experts, "bytes_mean", json_real(a->expert_mean));
    for (size_t i = 0; i < a->n_combos; i++) {
        json_t *o = json_object();
        if (!o) goto fail;
        json_object_set_new(o, "types", json_string(a->combos[i].types));
        json_object_set_new(o, "bytes_per_expert", jint(a->combos[i].expert_bytes));
        json_object_set_new(o, "layers", jint(a->combos[i].n_layers));
        json_object_set_new(o, "slabs", jint(a->combos[i].n_slabs));
        json_array_append_new(combos, o);
    }
    json_object_set_new(experts, "by_types", combos);
    combos = NULL;
    json_object_set_new(root, "experts", experts);
    experts = NULL;

    for (size_t i = 0; i < a->n_types; i++) {
        const kv_type_info *ti = kv_type_get_ref(a->types[i].type);
        json_t *o = json_object();
        if (!o) goto fail;
        json_object_set_new(o, "type", json_string(ti && ti->name ? ti->name : "?"));
        json_object_set_new(o, "type_id", jint(a->types[i].type));
        json_object_set_new(o, "tensors", jint(a->types[i].n_tensors));
        json_object_set_new(o, "bytes", jint(a->types[i].bytes));
        json_object_set_new(o, "share", json_real(share(a->types[i].bytes, a->tensor_bytes)));
        json_array_append_new(types, o);
    }
    json_object_set_new(root, "types", types);
    types = NULL;

    for (size_t i = 0; i < a->n_layers; i++) {
        const kv_anat_layer *l = &a->layers[i];
        json_t *o = json_object(), *by = json_object();
        if (!o || !by) {
            json_decref(o);
            json_decref(by);
            goto fail;
        }
        json_object_set_new(o, "index", jint(l->index));
        json_object_set_new(o, "kind", json_string(kind_str(l->kind, kb, sizeof kb)));
        json_object_set_new(o, "tensors", jint(l->n_tensors));
        json_object_set_new(o, "bytes", jint(l->total));
        for (int c = 0; c < KV_ANAT_CLASS_COUNT; c++)
            if (l->bytes[c]) json_object_set_new(by, class_ids[c], jint(l->bytes[c]));
        json_object_set_new(o, "classes", by);
        json_object_set_new(o, "n_expert", jint(l->n_expert));
        if (l->n_expert) {
            json_object_set_new(o, "expert_bytes", jint(l->expert_bytes));
            json_object_set_new(o, "expert_types", json_string(l->expert_types));
            if (l->expert_mismatch) json_object_set_new(o, "expert_count_mismatch", json_true());
        }
        json_array_append_new(layers, o);
    }
    json_object_set_new(root, "layers", layers);
    layers = NULL;
    char *s = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    return s;
fail:
    json_decref(root);
    json_decref(classes);
    json_decref(types);
    json_decref(layers);
    json_decref(experts);
    json_decref(combos);
    return NULL;
}

/* ---- human report ----------------------------------------------------- */

/* "5.31 MB" style, decimal units (1 MB = 10^6 bytes). */
static const char *human(uint64_t b, char *buf, size_t cap) {
    static const char *const u[] = {"B", "kB", "MB", "GB", "TB", "PB"};
    double v = (double)b;
    int i = 0;
    while (v >= 1000.0 && i < 5) {
        v /= 1000.0;
        i++;
    }
    if (i == 0)
        snprintf(buf, cap, "%" PRIu64 " B", b);
    else
        snprintf(buf, cap, "%.2f %s", v, u[i]);
    return buf;
}

/* 12,544 style */
static const char *grouped(uint64_t v, char *buf, size_t cap) {
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%" PRIu64, v);
    size_t o = 0;
    for (int i = 0; i < n && o + 2 < cap; i++) {
        if (i && (n - i) % 3 == 0) buf[o++] = ',';
        buf[o++] = tmp[i];
    }
    buf[o] = 0;
    return buf;
}

void kv_anatomy_print(const kv_anatomy *a, FILE *f) {
    char h1[32], h2[32], g1[32], g2[32], g3[32];
    fprintf(f, "architecture  %s%s%s%s\n", a->arch[0] ? a->arch : "(none)", a->name[0] ? "  (\"" : "",
            a->name, a->name[0] ? "\")" : "");
    fprintf(f, "size          %s (%s bytes): header %s, %s tensors, tensor data %s\n",
            human(a->file_size, h1, sizeof h1), grouped(a->file_size, g1, sizeof g1),
            human(a->data_offset, h2, sizeof h2), grouped(a->n_tensors, g2, sizeof g2),
            human(a->tensor_bytes, g3, sizeof g3));
    if (a->parts) {
        fprintf(f, "split         %zu parts (split.count), one model:\n", a->n_parts);
        for (size_t p = 0; p < a->n_parts; p++)
            fprintf(f, "  part %-5zu %12s  %6s tensors  tensor data %s\n", p + 1,
                    human(a->parts[p].file_size, h1, sizeof h1), grouped(a->parts[p].n_tensors, g1, sizeof g1),
                    human(a->parts[p].tensor_bytes, h2, sizeof h2));
    }
    if (a->n_uncomputable) {
        const kv_type_info *ti = kv_type_get_ref(a->uncomputable_type);
        fprintf(f, "unsupported   tensor '%s' has type %s (%u), which kvasir cannot compute", a->uncomputable,
                ti && ti->name ? ti->name : "?", a->uncomputable_type);
        if (a->n_uncomputable > 1) fprintf(f, " (%" PRIu64 " such tensors)", a->n_uncomputable);
        fprintf(f, "\n");
    }
    if (a->block_count)
        fprintf(f, "blocks        %u (block_count)%s\n", a->block_count,
                a->nextn_layers ? ", the last of them MTP (nextn_predict_layers)" : "");

    fprintf(f, "\nbytes by class\n");
    for (int c = 0; c < KV_ANAT_CLASS_COUNT; c++) {
        if (!a->class_tensors[c]) continue;
        fprintf(f, "  %-18s %12s  %6.2f%%  %18s B  %6s tensors\n", class_labels[c],
                human(a->class_bytes[c], h1, sizeof h1), 100.0 * share(a->class_bytes[c], a->tensor_bytes),
                grouped(a->class_bytes[c], g1, sizeof g1), grouped(a->class_tensors[c], g2, sizeof g2));
    }

    fprintf(f, "\nexpert slabs\n");
    if (!a->n_slabs) {
        fprintf(f, "  none (no *_exps tensors)\n");
    } else {
        bool uniform = true;
        for (size_t i = 0; i < a->n_layers; i++)
            if (a->layers[i].n_expert && a->layers[i].n_expert != a->layers[0].n_expert) uniform = false;
        uint32_t ne = 0;
        for (size_t i = 0; i < a->n_layers; i++)
            if (a->layers[i].n_expert) ne = a->layers[i].n_expert;
        if (uniform)
            fprintf(f, "  %u MoE layers x %u experts = %s slabs\n", a->n_moe_layers, ne,
                    grouped(a->n_slabs, g1, sizeof g1));
        else
            fprintf(f, "  %u MoE layers, %s slabs (expert counts differ by layer)\n", a->n_moe_layers,
                    grouped(a->n_slabs, g1, sizeof g1));
        char g4[32];
        uint64_t mean = (uint64_t)(a->expert_mean + 0.5);
        fprintf(f, "  bytes per expert: min %s (%s), max %s (%s), mean %s (%s)\n",
                grouped(a->expert_min, g1, sizeof g1), human(a->expert_min, h1, sizeof h1),
                grouped(a->expert_max, g2, sizeof g2), human(a->expert_max, h2, sizeof h2),
                grouped(mean, g4, sizeof g4), human(mean, g3, sizeof g3));
        fprintf(f, "  routed experts hold %.2f%% of the tensor bytes; the rest (the backbone) is %s\n",
                100.0 * share(a->class_bytes[KV_ANAT_ROUTED_EXPERTS], a->tensor_bytes),
                human(a->tensor_bytes - a->class_bytes[KV_ANAT_ROUTED_EXPERTS], h1, sizeof h1));
        fprintf(f, "  by types:\n");
        for (size_t i = 0; i < a->n_combos; i++)
            fprintf(f, "    %-34s %12s B (%s)  %3u layers  %6s slabs\n", a->combos[i].types,
                    grouped(a->combos[i].expert_bytes, g1, sizeof g1),
                    human(a->combos[i].expert_bytes, h1, sizeof h1), a->combos[i].n_layers,
                    grouped(a->combos[i].n_slabs, g2, sizeof g2));
    }

    fprintf(f, "\ntypes\n");
    for (size_t i = 0; i < a->n_types; i++) {
        const kv_type_info *ti = kv_type_get_ref(a->types[i].type);
        fprintf(f, "  %-8s %12s  %6.2f%%  %6s tensors\n", ti && ti->name ? ti->name : "?",
                human(a->types[i].bytes, h1, sizeof h1), 100.0 * share(a->types[i].bytes, a->tensor_bytes),
                grouped(a->types[i].n_tensors, g1, sizeof g1));
    }

    if (!a->n_layers) return;
    /* per-layer table: only the classes some layer holds */
    bool col[KV_ANAT_CLASS_COUNT] = {0};
    for (size_t i = 0; i < a->n_layers; i++)
        for (int c = 0; c < KV_ANAT_CLASS_COUNT; c++)
            if (a->layers[i].bytes[c]) col[c] = true;
    fprintf(f, "\nlayers (bytes per class, MB = 10^6 bytes)\n  %5s %-11s %9s", "blk", "kind", "total");
    for (int c = 0; c < KV_ANAT_CLASS_COUNT; c++)
        if (col[c]) fprintf(f, " %9s", class_cols[c]);
    fprintf(f, "  experts\n");
    for (size_t i = 0; i < a->n_layers; i++) {
        const kv_anat_layer *l = &a->layers[i];
        char kb[32];
        fprintf(f, "  %5u %-11s %9.2f", l->index, kind_str(l->kind, kb, sizeof kb), (double)l->total / 1e6);
        for (int c = 0; c < KV_ANAT_CLASS_COUNT; c++)
            if (col[c]) fprintf(f, " %9.2f", (double)l->bytes[c] / 1e6);
        if (l->n_expert)
            fprintf(f, "  %u x %s (%s)%s", l->n_expert, human(l->expert_bytes, h1, sizeof h1), l->expert_types,
                    l->expert_mismatch ? " [expert counts differ]" : "");
        fputc('\n', f);
    }
}
