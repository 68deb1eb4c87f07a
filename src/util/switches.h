/*
 * switches.h - the A/B switches of the environment (include/pi0.h lists them): a feature that is on by default is
 * turned off by setting its variable to "0", and only by that.
 */
#ifndef PI0_UTIL_SWITCHES_H
#define PI0_UTIL_SWITCHES_H

#include <stdlib.h>
#include <string.h>

/* Whether the environment turns the switch `name` off (name=0). */
static inline int switched_off(const char *name) {
    const char *value = getenv(name);
    return value && !strcmp(value, "0");
}

#endif
