/*
 * adapter.c - the built-in robot adapters (openpi's libero_policy.py and droid_policy.py, with what its
 * Pi0 and Pi0.5 configs set for these robots) and generic ones read from a JSON file (format in adapter.h).
 */
#include "policy/adapter.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/error.h"
#include "util/json_kind.h"

#define MAX_ACTION_DIMS 4096

void pi0_adapter_free(pi0_adapter *a) {
    if (!a) return;
    free(a->name);
    for (int c = 0; c < a->num_cameras; c++) free(a->camera_keys[c]);
    for (int s = 0; s < a->num_state_keys; s++) free(a->state_keys[s]);
    free(a->prompt_key);
    free(a->default_prompt);
    free(a);
}

/* strdup that tolerates NULL; sets *failed on an allocation failure. */
static char *dup_or_null(const char *s, int *failed) {
    if (!s) return NULL;
    char *d = strdup(s);
    if (!d) *failed = 1;
    return d;
}

/* A built-in adapter: cameras base, left wrist, then an absent right wrist (the model masks it). */
static pi0_status builtin(const char *name, const char *base, const char *wrist, const char *const *state_keys,
                          int num_state_keys, int action_dims, pi0_adapter **out, pi0_error *err) {
    pi0_adapter *a = calloc(1, sizeof *a);
    if (!a) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for adapter %s", name);
    int failed = 0;
    a->name = dup_or_null(name, &failed);
    a->num_cameras = 3;
    a->camera_keys[0] = dup_or_null(base, &failed);
    a->camera_keys[1] = dup_or_null(wrist, &failed);
    a->camera_keys[2] = NULL;
    a->num_state_keys = num_state_keys;
    for (int s = 0; s < num_state_keys; s++) a->state_keys[s] = dup_or_null(state_keys[s], &failed);
    a->prompt_key = dup_or_null("prompt", &failed);
    a->action_dims = action_dims;
    a->discrete_state = -1;
    if (failed) {
        pi0_adapter_free(a);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for adapter %s", name);
    }
    *out = a;
    return PI0_OK;
}

/* Reads "key": [strings (or null where allowed)] into keys[], at most `max` of them. */
static pi0_status read_key_list(const char *path, json_t *root, const char *field, int allow_null, int max,
                                char **keys, int *count, pi0_error *err) {
    json_t *arr = json_object_get(root, field);
    if (!arr) return pi0_fail(err, PI0_ERR_FORMAT, "%s: missing \"%s\"", path, field);
    if (!json_is_array(arr))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"%s\" is %s, expected an array of observation keys", path, field,
                        json_kind(arr));
    size_t n = json_array_size(arr);
    if (n == 0 || n > (size_t)max)
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"%s\" has %zu entries, expected 1 .. %d", path, field, n, max);
    int present = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        if (allow_null && json_is_null(v)) {
            keys[(*count)++] = NULL;
            continue;
        }
        if (!json_is_string(v) || json_string_length(v) == 0 || strlen(json_string_value(v)) != json_string_length(v))
            return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"%s\"[%zu] is %s, expected a non-empty key string%s", path, field,
                            i, json_is_string(v) ? "an empty or NUL-holding string" : json_kind(v),
                            allow_null ? " or null" : "");
        if (!(keys[*count] = strdup(json_string_value(v))))
            return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        (*count)++;
        present++;
    }
    if (!present) return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"%s\" names no key (all null)", path, field);
    return PI0_OK;
}

/* Reads an optional "key": "string" | null. *present tells whether the field was there at all. */
static pi0_status read_opt_string(const char *path, json_t *root, const char *field, char **out, int *present,
                                  pi0_error *err) {
    json_t *v = json_object_get(root, field);
    *present = v != NULL;
    if (!v || json_is_null(v)) return PI0_OK;
    if (!json_is_string(v) || strlen(json_string_value(v)) != json_string_length(v))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"%s\" is %s, expected a string or null", path, field,
                        json_is_string(v) ? "a string holding NUL" : json_kind(v));
    if (!(*out = strdup(json_string_value(v)))) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    return PI0_OK;
}

/* "optional_cameras": keys of "cameras" that an observation may leave out. */
static pi0_status read_optional_cameras(const char *path, json_t *root, pi0_adapter *a, pi0_error *err) {
    json_t *arr = json_object_get(root, "optional_cameras");
    if (!arr) return PI0_OK;
    if (!json_is_array(arr))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"optional_cameras\" is %s, expected an array of camera keys", path,
                        json_kind(arr));
    for (size_t i = 0; i < json_array_size(arr); i++) {
        json_t *v = json_array_get(arr, i);
        int found = -1;
        for (int c = 0; json_is_string(v) && c < a->num_cameras; c++)
            if (a->camera_keys[c] && !strcmp(a->camera_keys[c], json_string_value(v))) found = c;
        if (found < 0)
            return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"optional_cameras\"[%zu] is %s%s%s, which is not one of \"cameras\"",
                            path, i, json_is_string(v) ? "\"" : json_kind(v), json_is_string(v) ? json_string_value(v) : "",
                            json_is_string(v) ? "\"" : "");
        a->camera_optional[found] = 1;
    }
    return PI0_OK;
}

/* The file name without directories and a .json extension: the adapter's default name. */
static char *base_name(const char *path) {
    const char *slash = strrchr(path, '/'), *b = slash ? slash + 1 : path;
    size_t n = strlen(b);
    if (n > 5 && !strcmp(b + n - 5, ".json")) n -= 5;
    return strndup(b, n);
}

static pi0_status parse_generic(const char *path, json_t *root, pi0_adapter *a, pi0_error *err) {
    static const char *known[] = {"name", "cameras", "state", "prompt", "default_prompt", "action_dims",
                                  "discrete_state", "horizon", "optional_cameras"};
    if (!json_is_object(root))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: the adapter is %s, expected a JSON object", path, json_kind(root));
    const char *key;
    json_t *value;
    json_object_foreach(root, key, value) {
        int ok = 0;
        for (size_t k = 0; k < sizeof known / sizeof *known; k++) ok |= !strcmp(key, known[k]);
        if (!ok)
            return pi0_fail(err, PI0_ERR_FORMAT,
                            "%s: unknown key \"%s\" (expected name, cameras, optional_cameras, state, prompt, "
                            "default_prompt, action_dims, discrete_state, horizon)",
                            path, key);
    }
    pi0_status st;
    int present;
    if ((st = read_opt_string(path, root, "name", &a->name, &present, err))) return st;
    if (!a->name && !(a->name = base_name(path))) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    if ((st = read_key_list(path, root, "cameras", 1, PI0_ADAPTER_MAX_CAMERAS, a->camera_keys, &a->num_cameras, err)) ||
        (st = read_key_list(path, root, "state", 0, PI0_ADAPTER_MAX_STATE_KEYS, a->state_keys, &a->num_state_keys, err)))
        return st;
    if ((st = read_optional_cameras(path, root, a, err))) return st;
    /* "prompt" absent: openpi's usual key "prompt"; null: prompts are not read from observations */
    if ((st = read_opt_string(path, root, "prompt", &a->prompt_key, &present, err))) return st;
    if (!present && !(a->prompt_key = strdup("prompt")))
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    if (a->prompt_key && !a->prompt_key[0])
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"prompt\" is an empty key (use null to not read prompts)", path);
    if ((st = read_opt_string(path, root, "default_prompt", &a->default_prompt, &present, err))) return st;
    if (!a->prompt_key && !a->default_prompt)
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"prompt\" is null and there is no \"default_prompt\": no prompt source",
                        path);
    json_t *dims = json_object_get(root, "action_dims");
    if (!dims) return pi0_fail(err, PI0_ERR_FORMAT, "%s: missing \"action_dims\"", path);
    if (!json_is_integer(dims) || json_integer_value(dims) < 1 || json_integer_value(dims) > MAX_ACTION_DIMS)
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"action_dims\" must be an integer in 1 .. %d", path, MAX_ACTION_DIMS);
    a->action_dims = (int)json_integer_value(dims);
    json_t *discrete = json_object_get(root, "discrete_state"), *horizon = json_object_get(root, "horizon");
    if (discrete && !json_is_boolean(discrete))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"discrete_state\" is %s, expected true or false", path, json_kind(discrete));
    a->discrete_state = discrete ? json_is_true(discrete) : -1;
    if (horizon && (!json_is_integer(horizon) || json_integer_value(horizon) < 1 || json_integer_value(horizon) > PI0_MAX_HORIZON))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"horizon\" must be an integer in 1 .. %d", path, PI0_MAX_HORIZON);
    if (horizon) a->horizon[PI0_MODEL_PI0] = a->horizon[PI0_MODEL_PI05] = (int)json_integer_value(horizon);
    return PI0_OK;
}

pi0_status pi0_adapter_open(const char *name_or_path, pi0_adapter **out, pi0_error *err) {
    if (!name_or_path || !out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "adapter: NULL name or output");
    *out = NULL;
    if (!strcmp(name_or_path, "libero")) {
        static const char *const state[] = {"observation/state"};
        pi0_status st = builtin("libero", "observation/image", "observation/wrist_image", state, 1, 7, out, err);
        if (!st) (*out)->discrete_state = 0, (*out)->horizon[PI0_MODEL_PI05] = 10; /* openpi's pi05_libero */
        return st;
    }
    if (!strcmp(name_or_path, "droid")) {
        static const char *const state[] = {"observation/joint_position", "observation/gripper_position"};
        pi0_status st = builtin("droid", "observation/exterior_image_1_left", "observation/wrist_image_left", state, 2, 8,
                                out, err);
        if (!st) (*out)->horizon[PI0_MODEL_PI0] = 10, (*out)->horizon[PI0_MODEL_PI05] = 15; /* pi0_droid, pi05_droid */
        return st;
    }
    const char *path = name_or_path;
    FILE *f = fopen(path, "rb");
    if (!f)
        return pi0_fail(err, PI0_ERR_IO, "unknown adapter '%s': not libero or droid, and cannot open it as a JSON file: %s",
                        path, strerror(errno));
    json_error_t jerr;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!root) return pi0_fail(err, PI0_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", path, jerr.line, jerr.column, jerr.text);
    pi0_adapter *a = calloc(1, sizeof *a);
    pi0_status st = a ? parse_generic(path, root, a, err) : pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    json_decref(root);
    if (st) {
        pi0_adapter_free(a);
        return st;
    }
    *out = a;
    return PI0_OK;
}
