/*
 * powercut.so: an LD_PRELOAD shim that models a disk cache which loses
 * everything not synced when the power goes. What LazyFS does, in a form
 * the tests can build with gcc alone.
 *
 * Environment:
 *   POWERCUT_DIR     the directory whose files are modelled: regular files
 *                    directly in it (not in subdirectories), by their name.
 *   POWERCUT_SHADOW  another directory, where the shim keeps the durable
 *                    image of each modelled file under the same name.
 *   Without both, the shim passes every call through and models nothing.
 *   POWERCUT_FAIL_SYNCS  optional, a path: while a file exists there, every
 *                    fsync() and fdatasync() of a modelled file fails with
 *                    EIO and syncs nothing (a disk that stops taking
 *                    writes), so a test can fail syncs at a moment it picks.
 *
 * The model:
 *   - A file's durable image is its whole content as of its last
 *     fsync() or fdatasync(). On each such call on a modelled file the
 *     shim copies the file to POWERCUT_SHADOW, to a temporary name first,
 *     so that a kill -9 in the middle leaves the previous image.
 *     Only syncs do work; write() and friends are not intercepted, so
 *     whatever was written after the last sync is lost, whole.
 *   - Files that existed before the process started are durable as they
 *     were: whoever starts the process copies them into POWERCUT_SHADOW
 *     first. A file the process creates and never syncs is absent from
 *     the image.
 *   - Names: a synced file's directory entry counts as durable; a
 *     directory's fsync is not modelled. So the image cannot show the loss
 *     of a new file whose directory was never synced (SQLite syncs the
 *     directory at the first sync of a journal or WAL it created; in WAL
 *     mode with synchronous=NORMAL, that is the first checkpoint).
 *     unlink() and rename() of modelled files apply to the image at once,
 *     as if the directory were synced right after: a file deleted is
 *     absent, a file renamed takes its durable image (or none) to its new
 *     name, and a file moved in from outside the directory has none.
 *     SQLite in WAL mode deletes the WAL and -shm files at a clean close,
 *     after checkpointing and syncing the database, so the image never
 *     holds a WAL the process had dropped; in rollback mode (which it uses
 *     to switch a new file to WAL) it deletes the journal once the commit
 *     is synced.
 *   - Not modelled, because SQLite and the server do not use them:
 *     sync_file_range(), sync(), syncfs(), msync() (the -shm file is
 *     shared memory and never durable), O_SYNC/O_DSYNC writes (treated as
 *     unsynced: a test sees a loss, not a false durability).
 *   - The image is stricter than a real disk in one way (nothing unsynced
 *     survives, not even partly) and kinder in another (a sync is atomic
 *     and writes are never torn or reordered). It checks that every
 *     promise of durability rests on a sync, not how SQLite survives torn
 *     pages.
 *
 * A power cut is then: kill -9 the process and build a directory from
 * POWERCUT_SHADOW's files, leaving out -shm files and partial copies
 * (".powercut-partial-NAME"); a complete copy left by a kill in the middle
 * of a sync (".powercut-done-NAME") is NAME's image.
 *
 * Interposition: SQLite's unix VFS calls fdatasync() directly and unlink()
 * through its table of system calls, whose addresses the dynamic linker
 * resolves; Python's os.fsync, os.fdatasync, os.unlink and os.rename call
 * libc's. All of them reach this shim's, which call libc's own (dlsym
 * RTLD_NEXT). Syncs and name
 * changes of modelled files take one lock, so that two threads' images of
 * one file land in the order of their syncs and a deleted file's image is
 * not brought back by a sync that was copying it. A shim that cannot keep
 * its image (no space, a bad directory) stops the process with exit status
 * 86 and a message, rather than let a test take a missing image for a lost
 * write.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FAILED_STATUS 86
/* The shadow's names for an image being copied, and for one complete but
 * not yet under its own name. */
#define PARTIAL_PREFIX ".powercut-partial-"
#define DONE_PREFIX ".powercut-done-"

static char model_dir[PATH_MAX];
static char shadow_dir[PATH_MAX];
static int active;
static char fail_flag[PATH_MAX];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_unlink)(const char *);
static int (*real_unlinkat)(int, const char *, int);
static int (*real_renameat)(int, const char *, int, const char *);
static int (*real_renameat2)(int, const char *, int, const char *, unsigned int);

static void die(const char *format, ...) {
    char message[2 * PATH_MAX + 200];
    va_list args;
    va_start(args, format);
    int length = vsnprintf(message, sizeof message, format, args);
    va_end(args);
    if (length > (int)sizeof message - 1) length = (int)sizeof message - 1;
    /* write(), not stdio: the process may be anywhere, in any thread. */
    ssize_t ignored = write(2, message, (size_t)length);
    (void)ignored;
    _exit(FAILED_STATUS);
}

static void *next(const char *name) {
    void *found = dlsym(RTLD_NEXT, name);
    if (found == NULL) die("powercut: no %s in libc: %s\n", name, dlerror());
    return found;
}

__attribute__((constructor)) static void powercut_init(void) {
    real_fsync = next("fsync");
    real_fdatasync = next("fdatasync");
    real_unlink = next("unlink");
    real_unlinkat = next("unlinkat");
    real_renameat = next("renameat");
    /* glibc has had renameat2 since 2.28; an older one simply lacks it. */
    real_renameat2 = dlsym(RTLD_NEXT, "renameat2");
    const char *dir = getenv("POWERCUT_DIR");
    const char *shadow = getenv("POWERCUT_SHADOW");
    if (dir == NULL || shadow == NULL) return;
    if (realpath(dir, model_dir) == NULL)
        die("powercut: POWERCUT_DIR %s: %s\n", dir, strerror(errno));
    if (realpath(shadow, shadow_dir) == NULL)
        die("powercut: POWERCUT_SHADOW %s: %s\n", shadow, strerror(errno));
    if (strcmp(model_dir, shadow_dir) == 0) die("powercut: POWERCUT_DIR is POWERCUT_SHADOW\n");
    const char *fail = getenv("POWERCUT_FAIL_SYNCS");
    if (fail != NULL) {
        if (strlen(fail) >= sizeof fail_flag) die("powercut: POWERCUT_FAIL_SYNCS is too long\n");
        strcpy(fail_flag, fail);
    }
    active = 1;
}

/* The name in model_dir of `path` (taken relative to `dirfd`): a pointer
 * into `path`, or NULL when it is not a file directly in model_dir. `path`
 * need not exist. */
static const char *modelled_name(int dirfd, const char *path) {
    char absolute[PATH_MAX], parent[PATH_MAX];
    if (path[0] == '/') {
        if (snprintf(absolute, sizeof absolute, "%s", path) >= (int)sizeof absolute) return NULL;
    } else {
        char base[PATH_MAX];
        if (dirfd == AT_FDCWD) {
            if (getcwd(base, sizeof base) == NULL) return NULL;
        } else {
            char link[64];
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
            ssize_t length = readlink(link, base, sizeof base - 1);
            if (length < 0) return NULL;
            base[length] = '\0';
        }
        if (snprintf(absolute, sizeof absolute, "%s/%s", base, path) >= (int)sizeof absolute)
            return NULL;
    }
    char *slash = strrchr(absolute, '/');
    const char *name = path + strlen(path) - strlen(slash + 1);
    if (*name == '\0' || strcmp(name, ".") == 0 || strcmp(name, "..") == 0) return NULL;
    *slash = '\0';
    /* The directory part may hold "..", "." or symbolic links. */
    if (realpath(absolute[0] ? absolute : "/", parent) == NULL) return NULL;
    if (strcmp(parent, model_dir) != 0) return NULL;
    return name;
}

static void shadow_path(char *out, const char *prefix, const char *name) {
    if (snprintf(out, PATH_MAX, "%s/%s%s", shadow_dir, prefix, name) >= PATH_MAX)
        die("powercut: name too long: %s\n", name);
}

/* Copy `source` to `copy` from their offsets on: in the kernel where the
 * file system can, else through a buffer. */
static void copy_all(int source, int copy, const char *path) {
    for (;;) {
        ssize_t moved = copy_file_range(source, NULL, copy, NULL, 1 << 30, 0);
        if (moved == 0) return;
        if (moved > 0 || errno == EINTR) continue;
        if (errno == ENOSYS || errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP) break;
        die("powercut: copying %s: %s\n", path, strerror(errno));
    }
    char buffer[1 << 16];
    for (;;) {
        ssize_t got = read(source, buffer, sizeof buffer);
        if (got == 0) return;
        if (got < 0) {
            if (errno == EINTR) continue;
            die("powercut: reading %s: %s\n", path, strerror(errno));
        }
        for (ssize_t done = 0; done < got;) {
            ssize_t put = write(copy, buffer + done, (size_t)(got - done));
            if (put < 0 && errno != EINTR)
                die("powercut: copying %s: %s\n", path, strerror(errno));
            if (put > 0) done += put;
        }
    }
}

/* Copy what `fd` holds now to the shadow, atomically. Called with the lock. */
static void keep_image(int fd) {
    struct stat open_file;
    if (fstat(fd, &open_file) != 0 || !S_ISREG(open_file.st_mode)) return;
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t length = readlink(link, path, sizeof path - 1);
    if (length < 0) return;
    path[length] = '\0';
    const char *name = modelled_name(AT_FDCWD, path);
    if (name == NULL) return;
    /* A file deleted or renamed over has no name to be durable under
     * (readlink then says "... (deleted)", or names another file). */
    struct stat named;
    if (stat(path, &named) != 0 || named.st_dev != open_file.st_dev
        || named.st_ino != open_file.st_ino)
        return;

    char partial[PATH_MAX], done[PATH_MAX], target[PATH_MAX];
    shadow_path(partial, PARTIAL_PREFIX, name);
    shadow_path(done, DONE_PREFIX, name);
    shadow_path(target, "", name);
    /* Read through a new descriptor: `fd` may be write-only, and its
     * offset belongs to the program. */
    int source = open(link, O_RDONLY | O_CLOEXEC);
    if (source < 0) die("powercut: cannot read %s: %s\n", path, strerror(errno));
    int copy = open(partial, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (copy < 0) die("powercut: cannot write %s: %s\n", partial, strerror(errno));
    copy_all(source, copy, path);
    close(source);
    if (close(copy) != 0) die("powercut: writing %s: %s\n", partial, strerror(errno));
    /* Not one rename over the old image: ext4 writes a file renamed over
     * another to the disk at once (auto_da_alloc), which made every sync
     * a real write, gigabytes per test run. Renamed to a free name, a copy
     * that the next sync replaces stays in memory. A kill -9 between these
     * steps leaves the new image complete under DONE_PREFIX, and whoever
     * builds the crash image takes that one. */
    if (real_renameat(AT_FDCWD, partial, AT_FDCWD, done) != 0)
        die("powercut: renaming %s: %s\n", partial, strerror(errno));
    if (real_unlink(target) != 0 && errno != ENOENT)
        die("powercut: deleting %s: %s\n", target, strerror(errno));
    if (real_renameat(AT_FDCWD, done, AT_FDCWD, target) != 0)
        die("powercut: renaming %s: %s\n", done, strerror(errno));
}

static int synced(int fd, int (*sync)(int)) {
    if (!active) return sync(fd);
    if (fail_flag[0] != '\0' && access(fail_flag, F_OK) == 0) {
        errno = EIO;
        return -1;
    }
    pthread_mutex_lock(&lock);
    int result = sync(fd);
    int error = errno;
    /* A failed sync promised nothing. */
    if (result == 0) keep_image(fd);
    pthread_mutex_unlock(&lock);
    errno = error;
    return result;
}

int fsync(int fd) { return synced(fd, real_fsync); }

int fdatasync(int fd) { return synced(fd, real_fdatasync); }

static void drop_image(const char *name) {
    char target[PATH_MAX];
    shadow_path(target, "", name);
    if (real_unlink(target) != 0 && errno != ENOENT)
        die("powercut: cannot delete %s: %s\n", target, strerror(errno));
}

static void move_image(const char *from, const char *to) {
    char source[PATH_MAX], target[PATH_MAX];
    shadow_path(source, "", from);
    shadow_path(target, "", to);
    if (real_renameat(AT_FDCWD, source, AT_FDCWD, target) == 0) return;
    if (errno != ENOENT) die("powercut: cannot rename %s: %s\n", source, strerror(errno));
    /* The file renamed was never synced: its new name holds nothing durable. */
    drop_image(to);
}

int unlinkat(int dirfd, const char *path, int flags) {
    const char *name = active ? modelled_name(dirfd, path) : NULL;
    if (name == NULL) return real_unlinkat(dirfd, path, flags);
    pthread_mutex_lock(&lock);
    int result = real_unlinkat(dirfd, path, flags);
    int error = errno;
    if (result == 0 && !(flags & AT_REMOVEDIR)) drop_image(name);
    pthread_mutex_unlock(&lock);
    errno = error;
    return result;
}

int unlink(const char *path) { return unlinkat(AT_FDCWD, path, 0); }

/* rename, renameat and renameat2 all come here; `flags` is renameat2's. */
static int real_renaming(int fromfd, const char *from, int tofd, const char *to,
                         unsigned int flags) {
    if (real_renameat2 != NULL) return real_renameat2(fromfd, from, tofd, to, flags);
    if (flags != 0) {
        errno = ENOSYS;
        return -1;
    }
    return real_renameat(fromfd, from, tofd, to);
}

int renameat2(int fromfd, const char *from, int tofd, const char *to, unsigned int flags) {
    const char *from_name = active ? modelled_name(fromfd, from) : NULL;
    const char *to_name = active ? modelled_name(tofd, to) : NULL;
    if (from_name == NULL && to_name == NULL) return real_renaming(fromfd, from, tofd, to, flags);
    if (flags & RENAME_EXCHANGE) die("powercut: RENAME_EXCHANGE is not modelled\n");
    pthread_mutex_lock(&lock);
    int result = real_renaming(fromfd, from, tofd, to, flags);
    int error = errno;
    if (result == 0) {
        if (from_name != NULL && to_name != NULL)
            move_image(from_name, to_name);
        else if (from_name != NULL)
            drop_image(from_name); /* moved out of the model: gone from it */
        else
            drop_image(to_name); /* moved in: nothing of it synced here yet */
    }
    pthread_mutex_unlock(&lock);
    errno = error;
    return result;
}

int renameat(int fromfd, const char *from, int tofd, const char *to) {
    return renameat2(fromfd, from, tofd, to, 0);
}

int rename(const char *from, const char *to) { return renameat2(AT_FDCWD, from, AT_FDCWD, to, 0); }
