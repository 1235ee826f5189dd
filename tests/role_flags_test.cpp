// The launcher's argv and the children's flags agree: every setting role_argv
// writes is read back by add_worker_flags / add_front_flags into the same value.
#include <gtest/gtest.h>

#include "cli/role_flags.h"

using namespace duet;

namespace {

// Parses argv (argv[1] the subcommand) into fresh settings.
template <class Settings>
Settings parse(const std::vector<std::string>& argv, bool prefill) {
    CLI::App app;
    Settings got;
    CLI::App* sub = app.add_subcommand(argv.at(1));
    if constexpr (std::is_same_v<Settings, WorkerSettings>)
        add_worker_flags(*sub, got, prefill);
    else
        add_front_flags(*sub, got);
    std::vector<const char*> c;
    for (const std::string& a : argv) c.push_back(a.c_str());
    app.parse(static_cast<int>(c.size()), c.data());
    return got;
}

}  // namespace

TEST(RoleFlags, WorkerSettingsSurviveTheArgv) {
    WorkerSettings w;
    w.instance = "serve-1";
    w.model = "/m/model.gguf";
    w.index = 3;
    w.numa = 1;
    w.threads = 6;
    w.cpus = "2-7";
    w.isa = "avx512";
    w.prefill_budget = 96;
    w.prefix_cache = false;
    w.risk_claims = false;
    w.pass_interrupt = false;
    w.device = "cuda:2";
    w.cuda_graphs = false;
    w.cuda_qgemv = true;
    w.swap_dir = "/var/tmp/duet-swap-serve-1";
    w.borrow_cpus = "0-1";
    RoleLaunch r{"prefill", "prefill 3", w, {}, 1};
    const std::vector<std::string> argv = role_argv("/bin/duet", r);
    EXPECT_EQ(argv[0], "/bin/duet");
    EXPECT_EQ(argv[1], "prefill");
    EXPECT_EQ(parse<WorkerSettings>(argv, true), w);

    // Decode takes no prefill flags; its defaults stay.
    WorkerSettings d = w;
    d.prefill_budget = WorkerSettings{}.prefill_budget;
    d.prefix_cache = true;
    d.risk_claims = true;
    d.pass_interrupt = true;
    d.max_batch = 9;  // decode's own
    d.max_draft = 5;
    d.draft_pool_tokens = 4096;
    RoleLaunch rd{"decode", "decode 3", d, {}, 1};
    EXPECT_EQ(parse<WorkerSettings>(role_argv("/bin/duet", rd), false), d);
    d.prefix_cache = false;  // decode's too: it publishes no finished answers
    rd.settings = d;
    EXPECT_EQ(parse<WorkerSettings>(role_argv("/bin/duet", rd), false), d);

    WorkerSettings plain;  // defaults, no CPUs, no ISA
    plain.instance = "x";
    plain.model = "m.gguf";
    RoleLaunch rp{"prefill", "prefill", plain, {}, 0};
    EXPECT_EQ(parse<WorkerSettings>(role_argv("duet", rp), true), plain);
}

TEST(RoleFlags, FrontSettingsSurviveTheArgv) {
    FrontSettings f;
    f.instance = "serve-9";
    f.model = "/m/model.gguf";
    f.host = "0.0.0.0";
    f.port = 18080;
    f.io_threads = 5;
    f.grace_s = 3;
    f.chat_template = "llama3";
    f.cpus = "0,8";
    f.contexts_dir = "/var/lib/duet/contexts";
    f.contexts_max = 77;
    f.contexts_disk_max = 5ull << 30;
    f.scheduling.admit_kv = 0.8;
    RoleLaunch r{"front", "front", f, {0, 8}, 0};
    const std::vector<std::string> argv = role_argv("duet", r);
    EXPECT_EQ(argv[1], "front");
    EXPECT_EQ(parse<FrontSettings>(argv, false), f);
}

TEST(RoleFlags, ThePrefillBudgetHasOneNameFromServeToTheWorker) {
    WorkerSettings w;
    w.instance = "x";
    w.model = "m";
    w.prefill_budget = 64;
    RoleLaunch r{"prefill", "prefill", w, {}, 0};
    const std::vector<std::string> argv = role_argv("duet", r);
    bool found = false;
    for (size_t i = 0; i + 1 < argv.size(); ++i)
        if (argv[i] == "--prefill-budget") found = argv[i + 1] == "64";
    EXPECT_TRUE(found) << "the worker takes --prefill-budget as `duet serve` does";
    ServeSettings s;
    CLI::App app;
    add_serve_flags(app, s);
    const char* a[] = {"serve", "--prefill-budget", "64"};
    app.parse(3, a);
    EXPECT_EQ(s.prefill_budget, 64);
}

TEST(RoleFlags, ThePrefillPassTimeGoesFromServeToTheWorker) {
    WorkerSettings w;
    w.instance = "x";
    w.model = "m";
    w.prefill_pass_ms = 90;
    w.prefill_cut_window_s = 7;
    const std::vector<std::string> argv = role_argv("duet", RoleLaunch{"prefill", "prefill", w, {}, 0});
    bool found = false, window = false;
    for (size_t i = 0; i + 1 < argv.size(); ++i) {
        if (argv[i] == "--prefill-pass-ms") found = argv[i + 1] == "90";
        if (argv[i] == "--prefill-cut-window") window = argv[i + 1] == "7";
    }
    EXPECT_TRUE(found);
    EXPECT_TRUE(window);
    ServeSettings s;
    CLI::App app;
    add_serve_flags(app, s);
    EXPECT_EQ(s.prefill_pass_ms, 250);
    EXPECT_EQ(s.prefill_cut_window_s, 60);
    const char* a[] = {"serve", "--prefill-pass-ms", "0", "--prefill-cut-window", "0"};
    app.parse(5, a);
    EXPECT_EQ(s.prefill_pass_ms, 0);
    EXPECT_EQ(s.prefill_cut_window_s, 0);
}

TEST(RoleFlags, CoresAreLentUnlessServeIsToldNot) {
    ServeSettings s;
    CLI::App app;
    add_serve_flags(app, s);
    EXPECT_TRUE(s.lend_cores);
    const char* a[] = {"serve", "--no-lend-cores"};
    app.parse(2, a);
    EXPECT_FALSE(s.lend_cores);
    ServeSettings t;
    CLI::App app2;
    add_serve_flags(app2, t);
    const char* b[] = {"serve", "--lend-cores"};
    app2.parse(2, b);
    EXPECT_TRUE(t.lend_cores);
}
