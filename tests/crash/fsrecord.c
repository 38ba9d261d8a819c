/* fsrecord: an LD_PRELOAD shim that records what a process asks of the file system.
 *
 * Built at test time (tests/crash/recorder.py) into a temp dir; never committed as a binary.
 * Every call below under the directory CRASHSIM_ROOT is logged to CRASHSIM_LOG, in order, with
 * a global sequence number and a CLOCK_MONOTONIC time, *before the call returns*:
 *
 *   record = header | path | path2 | data           (little-endian, packed)
 *   header = magic u32 "CSR1" | type u32 | seq u64 | t_ns i64 | a i64 | b i64
 *            | len(path) u32 | len(path2) u32 | len(data) u64                (56 bytes)
 *
 *   type  1 CREATE path (a = open flags)     5 RENAME path -> path2
 *         2 TRUNC path to a bytes            6 UNLINK path
 *         3 WRITE path at offset a, data     7 RMDIR path
 *         4 MKDIR path                       8 SYNC path: durable up to seq a (fsync begun
 *                                              when the sequence was at a; logged on return)
 *
 * Stores through a MAP_SHARED writable mapping make no system call: the shim keeps a shadow
 * copy of each such mapping and, at fsync / msync / munmap of its file, logs the bytes that
 * differ as WRITE records (so they count as written just before that sync, never earlier).
 *
 * CRASHSIM_NOSYNC=1 turns fsync, fdatasync and msync into no-ops that report success and are
 * not logged: the "store with its fsync switched off" the checker must catch.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { T_CREATE = 1, T_TRUNC, T_WRITE, T_MKDIR, T_RENAME, T_UNLINK, T_RMDIR, T_SYNC };

#pragma pack(push, 1)
struct hdr {
    uint32_t magic, type;
    uint64_t seq;
    int64_t t_ns, a, b;
    uint32_t len1, len2;
    uint64_t dlen;
};
#pragma pack(pop)

struct region {
    void *addr;
    size_t len;
    off_t off;
    char path[PATH_MAX];
    unsigned char *shadow;
    struct region *next;
};

static pthread_mutex_t mu = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static int log_fd = -1, nosync = 0, ready = 0;
static char root[PATH_MAX];
static size_t root_len;
static uint64_t seq = 0;
static struct region *regions = NULL;
static __thread int busy = 0;

#define REAL(ret, name, ...) \
    static ret (*real_##name)(__VA_ARGS__); \
    if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

static ssize_t (*raw_write)(int, const void *, size_t);

static void init(void) {
    if (ready) return;
    pthread_mutex_lock(&mu);
    if (!ready) {
        raw_write = dlsym(RTLD_NEXT, "write");
        const char *r = getenv("CRASHSIM_ROOT"), *l = getenv("CRASHSIM_LOG");
        nosync = getenv("CRASHSIM_NOSYNC") && *getenv("CRASHSIM_NOSYNC") == '1';
        if (r && l) {
            snprintf(root, sizeof root, "%s", r);
            root_len = strlen(root);
            int (*ro)(const char *, int, ...) = dlsym(RTLD_NEXT, "open");
            log_fd = ro(l, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        }
        ready = 1;
    }
    pthread_mutex_unlock(&mu);
}

static int under_root(const char *p) {
    return log_fd >= 0 && strncmp(p, root, root_len) == 0 && (p[root_len] == '/' || !p[root_len]);
}

/* Absolute path of `p` relative to dirfd (AT_FDCWD or a directory fd); no symlink resolving. */
static int abs_path(int dirfd, const char *p, char *out) {
    if (p[0] == '/') {
        snprintf(out, PATH_MAX, "%s", p);
        return 0;
    }
    char base[PATH_MAX];
    if (dirfd == AT_FDCWD) {
        if (!getcwd(base, sizeof base)) return -1;
    } else {
        char link[64];
        snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
        ssize_t n = readlink(link, base, sizeof base - 1);
        if (n < 0) return -1;
        base[n] = 0;
    }
    if (snprintf(out, PATH_MAX, "%s/%s", base, p) >= PATH_MAX) return -1;
    return 0;
}

static int fd_path(int fd, char *out) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, out, PATH_MAX - 1);
    if (n < 0) return -1;
    out[n] = 0;
    return 0;
}

static void emit_locked(uint32_t type, int64_t a, const char *p1, const char *p2, const void *d,
                        uint64_t dlen) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    struct hdr h = {0x31525343u, type, ++seq, (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec,
                    a, 0, p1 ? (uint32_t)strlen(p1) : 0, p2 ? (uint32_t)strlen(p2) : 0, dlen};
    struct iovec iov[4] = {{&h, sizeof h}, {(void *)p1, h.len1}, {(void *)p2, h.len2},
                           {(void *)d, dlen}};
    static ssize_t (*wv)(int, const struct iovec *, int);
    if (!wv) wv = dlsym(RTLD_NEXT, "writev");
    size_t total = sizeof h + h.len1 + h.len2 + dlen;
    ssize_t n = wv(log_fd, iov, 4);
    if (n != (ssize_t)total) abort(); /* a partial log would be worse than none */
}

static void emit(uint32_t type, int64_t a, const char *p1, const char *p2, const void *d,
                 uint64_t dlen) {
    pthread_mutex_lock(&mu);
    emit_locked(type, a, p1, p2, d, dlen);
    pthread_mutex_unlock(&mu);
}

/* Log what changed through the mappings of `path` since the last look (mu held). */
static void diff_regions_locked(const char *path) {
    for (struct region *r = regions; r; r = r->next) {
        if (strcmp(r->path, path)) continue;
        unsigned char *m = r->addr;
        size_t i = 0;
        while (i < r->len) {
            if (m[i] == r->shadow[i]) {
                i++;
                continue;
            }
            size_t j = i, same = 0;
            while (j < r->len && same < 64) {
                same = m[j] == r->shadow[j] ? same + 1 : 0;
                j++;
            }
            size_t end = j - same;
            emit_locked(T_WRITE, (int64_t)(r->off + i), path, NULL, m + i, end - i);
            memcpy(r->shadow + i, m + i, end - i);
            i = j;
        }
    }
}

/* After a write(2) into a mapped file: the mapping shows it too; keep the shadow in step. */
static void shadow_written_locked(const char *path, off_t off, size_t len) {
    for (struct region *r = regions; r; r = r->next) {
        if (strcmp(r->path, path)) continue;
        off_t lo = off > r->off ? off : r->off;
        off_t hi = off + (off_t)len < r->off + (off_t)r->len ? off + (off_t)len
                                                              : r->off + (off_t)r->len;
        if (lo < hi) memcpy(r->shadow + (lo - r->off), (char *)r->addr + (lo - r->off), hi - lo);
    }
}

ssize_t write(int fd, const void *buf, size_t n) {
    init();
    if (busy || log_fd < 0) return raw_write(fd, buf, n);
    busy = 1;
    char p[PATH_MAX];
    ssize_t r;
    if (!fd_path(fd, p) && under_root(p)) {
        /* Under the lock, so the offset and the log order match the file's. */
        pthread_mutex_lock(&mu);
        off_t off = lseek(fd, 0, SEEK_CUR);
        if (fcntl(fd, F_GETFL) & O_APPEND) off = lseek(fd, 0, SEEK_END);
        r = raw_write(fd, buf, n);
        if (r > 0) {
            emit_locked(T_WRITE, off, p, NULL, buf, (uint64_t)r);
            shadow_written_locked(p, off, (size_t)r);
        }
        pthread_mutex_unlock(&mu);
    } else {
        r = raw_write(fd, buf, n);
    }
    busy = 0;
    return r;
}

static ssize_t do_pwrite(int fd, const void *buf, size_t n, off_t off) {
    REAL(ssize_t, pwrite64, int, const void *, size_t, off_t);
    char p[PATH_MAX];
    if (busy || log_fd < 0 || fd_path(fd, p) || !under_root(p)) return real_pwrite64(fd, buf, n, off);
    busy = 1;
    pthread_mutex_lock(&mu);
    ssize_t r = real_pwrite64(fd, buf, n, off);
    if (r > 0) {
        emit_locked(T_WRITE, off, p, NULL, buf, (uint64_t)r);
        shadow_written_locked(p, off, (size_t)r);
    }
    pthread_mutex_unlock(&mu);
    busy = 0;
    return r;
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) { init(); return do_pwrite(fd, buf, n, off); }
ssize_t pwrite64(int fd, const void *buf, size_t n, off_t off) { init(); return do_pwrite(fd, buf, n, off); }

static ssize_t gather_write(int fd, const struct iovec *iov, int cnt, off_t off, int use_pos) {
    REAL(ssize_t, writev, int, const struct iovec *, int);
    REAL(ssize_t, pwritev64, int, const struct iovec *, int, off_t);
    char p[PATH_MAX];
    if (busy || log_fd < 0 || fd_path(fd, p) || !under_root(p))
        return use_pos ? real_pwritev64(fd, iov, cnt, off) : real_writev(fd, iov, cnt);
    busy = 1;
    size_t total = 0;
    for (int i = 0; i < cnt; i++) total += iov[i].iov_len;
    unsigned char *flat = malloc(total ? total : 1);
    for (size_t i = 0, at = 0; i < (size_t)cnt; at += iov[i].iov_len, i++)
        memcpy(flat + at, iov[i].iov_base, iov[i].iov_len);
    pthread_mutex_lock(&mu);
    if (!use_pos) off = lseek(fd, 0, SEEK_CUR);
    ssize_t r = use_pos ? real_pwritev64(fd, iov, cnt, off) : real_writev(fd, iov, cnt);
    if (r > 0) {
        emit_locked(T_WRITE, off, p, NULL, flat, (uint64_t)r);
        shadow_written_locked(p, off, (size_t)r);
    }
    pthread_mutex_unlock(&mu);
    free(flat);
    busy = 0;
    return r;
}
ssize_t writev(int fd, const struct iovec *iov, int cnt) { init(); return gather_write(fd, iov, cnt, 0, 0); }
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) { init(); return gather_write(fd, iov, cnt, off, 1); }
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off_t off) { init(); return gather_write(fd, iov, cnt, off, 1); }

static int do_open(int dirfd, const char *path, int flags, mode_t mode, int at) {
    REAL(int, openat64, int, const char *, int, ...);
    char p[PATH_MAX];
    if (busy || log_fd < 0 || !(flags & (O_CREAT | O_TRUNC)) || abs_path(dirfd, path, p) ||
        !under_root(p))
        return real_openat64(at ? dirfd : AT_FDCWD, path, flags, mode);
    busy = 1;
    pthread_mutex_lock(&mu);
    int r = real_openat64(at ? dirfd : AT_FDCWD, path, flags, mode);
    if (r >= 0) emit_locked(T_CREATE, flags, p, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    busy = 0;
    return r;
}
#define MODE_ARG                                   \
    mode_t mode = 0;                               \
    if (flags & (O_CREAT | __O_TMPFILE)) {         \
        va_list ap;                                \
        va_start(ap, flags);                       \
        mode = va_arg(ap, mode_t);                 \
        va_end(ap);                                \
    }
int open(const char *path, int flags, ...) { init(); MODE_ARG return do_open(AT_FDCWD, path, flags, mode, 0); }
int open64(const char *path, int flags, ...) { init(); MODE_ARG return do_open(AT_FDCWD, path, flags, mode, 0); }
int openat(int d, const char *path, int flags, ...) { init(); MODE_ARG return do_open(d, path, flags, mode, 1); }
int openat64(int d, const char *path, int flags, ...) { init(); MODE_ARG return do_open(d, path, flags, mode, 1); }
int creat(const char *path, mode_t mode) { init(); return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 0); }
int creat64(const char *path, mode_t mode) { init(); return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 0); }

/* A path call: run it under the lock and log it if it succeeded under the root. */
#define PATH_CALL(type, dirfd, path, path2dirfd, path2, a, call)                              \
    char p1[PATH_MAX], p2[PATH_MAX];                                                          \
    init();                                                                                   \
    int logit = !busy && log_fd >= 0 && !abs_path(dirfd, path, p1) && under_root(p1);         \
    if (logit && (path2) && abs_path(path2dirfd, (const char *)(path2), p2)) logit = 0;       \
    if (!logit) return call;                                                                  \
    busy = 1;                                                                                 \
    pthread_mutex_lock(&mu);                                                                  \
    int r = call;                                                                             \
    if (r == 0) emit_locked(type, a, p1, (path2) ? p2 : NULL, NULL, 0);                       \
    pthread_mutex_unlock(&mu);                                                                \
    busy = 0;                                                                                 \
    return r

int mkdir(const char *path, mode_t mode) {
    REAL(int, mkdir, const char *, mode_t);
    PATH_CALL(T_MKDIR, AT_FDCWD, path, AT_FDCWD, (char *)NULL, 0, real_mkdir(path, mode));
}
int mkdirat(int d, const char *path, mode_t mode) {
    REAL(int, mkdirat, int, const char *, mode_t);
    PATH_CALL(T_MKDIR, d, path, AT_FDCWD, (char *)NULL, 0, real_mkdirat(d, path, mode));
}
int rename(const char *a, const char *b) {
    REAL(int, rename, const char *, const char *);
    PATH_CALL(T_RENAME, AT_FDCWD, a, AT_FDCWD, b, 0, real_rename(a, b));
}
int renameat(int da, const char *a, int db, const char *b) {
    REAL(int, renameat, int, const char *, int, const char *);
    PATH_CALL(T_RENAME, da, a, db, b, 0, real_renameat(da, a, db, b));
}
int renameat2(int da, const char *a, int db, const char *b, unsigned int fl) {
    REAL(int, renameat2, int, const char *, int, const char *, unsigned int);
    PATH_CALL(T_RENAME, da, a, db, b, 0, real_renameat2(da, a, db, b, fl));
}
int unlink(const char *path) {
    REAL(int, unlink, const char *);
    PATH_CALL(T_UNLINK, AT_FDCWD, path, AT_FDCWD, (char *)NULL, 0, real_unlink(path));
}
int rmdir(const char *path) {
    REAL(int, rmdir, const char *);
    PATH_CALL(T_RMDIR, AT_FDCWD, path, AT_FDCWD, (char *)NULL, 0, real_rmdir(path));
}
int unlinkat(int d, const char *path, int fl) {
    REAL(int, unlinkat, int, const char *, int);
    PATH_CALL((fl & AT_REMOVEDIR) ? T_RMDIR : T_UNLINK, d, path, AT_FDCWD, (char *)NULL, 0,
              real_unlinkat(d, path, fl));
}
int truncate(const char *path, off_t len) {
    REAL(int, truncate64, const char *, off_t);
    PATH_CALL(T_TRUNC, AT_FDCWD, path, AT_FDCWD, (char *)NULL, len, real_truncate64(path, len));
}
int truncate64(const char *path, off_t len) {
    REAL(int, truncate64, const char *, off_t);
    PATH_CALL(T_TRUNC, AT_FDCWD, path, AT_FDCWD, (char *)NULL, len, real_truncate64(path, len));
}

static int do_ftruncate(int fd, off_t len) {
    REAL(int, ftruncate64, int, off_t);
    char p[PATH_MAX];
    if (busy || log_fd < 0 || fd_path(fd, p) || !under_root(p)) return real_ftruncate64(fd, len);
    busy = 1;
    pthread_mutex_lock(&mu);
    diff_regions_locked(p); /* stores through a mapping made before the size changed */
    int r = real_ftruncate64(fd, len);
    if (r == 0) emit_locked(T_TRUNC, len, p, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    busy = 0;
    return r;
}
int ftruncate(int fd, off_t len) { init(); return do_ftruncate(fd, len); }
int ftruncate64(int fd, off_t len) { init(); return do_ftruncate(fd, len); }

/* posix_fallocate (the state log's zero tail): a size change when it extends the file, like
 * an ftruncate to the new end (the space reads as zeros). */
static int do_fallocate(int fd, off_t off, off_t len) {
    REAL(int, posix_fallocate64, int, off_t, off_t);
    char p[PATH_MAX];
    if (busy || log_fd < 0 || fd_path(fd, p) || !under_root(p)) return real_posix_fallocate64(fd, off, len);
    busy = 1;
    pthread_mutex_lock(&mu);
    struct stat st;
    off_t before = fstat(fd, &st) == 0 ? st.st_size : -1;
    int r = real_posix_fallocate64(fd, off, len);
    if (r == 0 && before >= 0 && off + len > before) emit_locked(T_TRUNC, off + len, p, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    busy = 0;
    return r;
}
int posix_fallocate(int fd, off_t off, off_t len) { init(); return do_fallocate(fd, off, len); }
int posix_fallocate64(int fd, off_t off, off_t len) { init(); return do_fallocate(fd, off, len); }

static int do_sync(int fd, int data_only) {
    REAL(int, fsync, int);
    REAL(int, fdatasync, int);
    char p[PATH_MAX];
    if (busy || log_fd < 0 || fd_path(fd, p) || !under_root(p))
        return data_only ? real_fdatasync(fd) : real_fsync(fd);
    if (nosync) return 0;
    busy = 1;
    pthread_mutex_lock(&mu);
    diff_regions_locked(p);
    uint64_t begun = seq;
    pthread_mutex_unlock(&mu);
    int r = data_only ? real_fdatasync(fd) : real_fsync(fd);
    if (r == 0) emit(T_SYNC, (int64_t)begun, p, NULL, NULL, 0);
    busy = 0;
    return r;
}
int fsync(int fd) { init(); return do_sync(fd, 0); }
int fdatasync(int fd) { init(); return do_sync(fd, 1); }

static struct region *region_of(void *addr) {
    for (struct region *r = regions; r; r = r->next)
        if ((char *)addr >= (char *)r->addr && (char *)addr < (char *)r->addr + r->len) return r;
    return NULL;
}

int msync(void *addr, size_t len, int flags) {
    REAL(int, msync, void *, size_t, int);
    init();
    if (busy || log_fd < 0) return real_msync(addr, len, flags);
    pthread_mutex_lock(&mu);
    struct region *r = region_of(addr);
    if (!r) {
        pthread_mutex_unlock(&mu);
        return real_msync(addr, len, flags);
    }
    if (nosync) {
        pthread_mutex_unlock(&mu);
        return 0;
    }
    busy = 1;
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", r->path);
    diff_regions_locked(p);
    uint64_t begun = seq;
    pthread_mutex_unlock(&mu);
    int rc = real_msync(addr, len, flags);
    if (rc == 0 && (flags & MS_SYNC)) emit(T_SYNC, (int64_t)begun, p, NULL, NULL, 0);
    busy = 0;
    return rc;
}

static void *do_mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    REAL(void *, mmap64, void *, size_t, int, int, int, off_t);
    void *m = real_mmap64(addr, len, prot, flags, fd, off);
    char p[PATH_MAX];
    if (m == MAP_FAILED || busy || log_fd < 0 || fd < 0 || !(flags & MAP_SHARED) ||
        !(prot & PROT_WRITE) || fd_path(fd, p) || !under_root(p))
        return m;
    busy = 1;
    struct region *r = calloc(1, sizeof *r);
    r->addr = m;
    r->len = len;
    r->off = off;
    snprintf(r->path, sizeof r->path, "%s", p);
    r->shadow = malloc(len);
    memcpy(r->shadow, m, len); /* a fresh segment: zeros; what is there is on file already */
    pthread_mutex_lock(&mu);
    r->next = regions;
    regions = r;
    pthread_mutex_unlock(&mu);
    busy = 0;
    return m;
}
void *mmap(void *a, size_t l, int pr, int fl, int fd, off_t o) { init(); return do_mmap(a, l, pr, fl, fd, o); }
void *mmap64(void *a, size_t l, int pr, int fl, int fd, off_t o) { init(); return do_mmap(a, l, pr, fl, fd, o); }

int munmap(void *addr, size_t len) {
    REAL(int, munmap, void *, size_t);
    init();
    if (log_fd >= 0) {
        pthread_mutex_lock(&mu);
        struct region **pp = &regions;
        while (*pp && (*pp)->addr != addr) pp = &(*pp)->next;
        if (*pp) {
            struct region *r = *pp;
            diff_regions_locked(r->path);
            *pp = r->next;
            free(r->shadow);
            free(r);
        }
        pthread_mutex_unlock(&mu);
    }
    return real_munmap(addr, len);
}
